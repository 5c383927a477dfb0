//! composer-agent (under construction)
