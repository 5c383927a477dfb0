#!/usr/bin/env bash
# Makes (or reuses) a venv with OpenEnv's Python clients of the MCP-tool interface:
# `openenv` 0.10.0 (MCPToolClient, GenericEnvClient), for the test that drives
# `composer-rl serve-env repo` with them (crates/env/tests/serve_repo_python.rs,
# `$OPENENV_MCP_VENV`), and its MCPEnvironment server for the tests of our client against
# it (crates/env/tests/openenv_mcp_client.rs, crates/train/tests/openenv_mcp_tool_chat.rs). `openenv` and `openenv-core` install the same import package, so this
# is a venv of its own, next to the openenv-core 0.3.0 one of ../shared/openenv.
#
# Usage: tools/openenv-mcp-venv.sh [DIR]   (default ./.openenv-mcp-venv); prints DIR.
# Re-running is a no-op once the pinned set is installed (stamp file DIR/.installed).
set -euo pipefail

OPENENV_VERSION="0.10.0"
# Pinned with it: the versions the wire shapes were checked with (openenv 0.10.0 needs
# fastmcp 3.x, hence mcp 1.x, unlike openenv-core 0.3.0's venv).
CONSTRAINTS="fastapi==0.165.0
starlette==1.10.0
uvicorn==0.54.0
pydantic==2.14.3
pydantic-core==2.50.4
websockets==17.4
fastmcp==3.4.11
fastmcp-slim==3.4.11
mcp==1.30.0
httpx==0.28.1"

DIR="${1:-./.openenv-mcp-venv}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
  || { echo "[openenv-mcp] ERROR: $PYTHON is older than 3.10" >&2; exit 1; }
if [[ ! -x "$DIR/bin/python" ]]; then
  "$PYTHON" -m venv "$DIR" >&2
fi
STAMP="openenv==$OPENENV_VERSION
$CONSTRAINTS"
if [[ "$(cat "$DIR/.installed" 2>/dev/null || true)" != "$STAMP" ]]; then
  echo "[openenv-mcp] installing openenv==$OPENENV_VERSION into $DIR" >&2
  printf '%s\n' "$CONSTRAINTS" > "$DIR/constraints.txt"
  "$DIR/bin/python" -m pip install -q --disable-pip-version-check \
      -c "$DIR/constraints.txt" "openenv==$OPENENV_VERSION" >&2
  "$DIR/bin/python" -c 'from openenv.core.mcp_client import MCPToolClient' >&2
  printf '%s' "$STAMP" > "$DIR/.installed"
fi
echo "$DIR"
