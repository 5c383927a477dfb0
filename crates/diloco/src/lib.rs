//! composer-diloco: DiLoCo (Douillard et al. 2023) and streaming DiLoCo across replica
//! processes that meet only through an object store (local folder, S3; GCS/Azure with the
//! matching object_store features).
//!
//! A trainer opens the store ([`open_store`]), joins ([`DilocoReplica::join`]) with its
//! parameters, and calls [`DilocoReplica::after_inner_step`] after every inner optimizer step;
//! every H / F steps that publishes a pseudo-gradient Δ = θ_global − θ_local, waits for the
//! round's quorum, applies the outer Nesterov SGD step to the average and writes the new
//! weights back into the trainer's vars. The key layout and consistency argument are in the
//! crate README.

pub mod bench;
pub mod codec;
pub mod config;
pub mod outer;
pub mod replica;
pub mod replica_hook;
pub mod store;
pub mod toy;

pub use config::{Compression, DilocoConfig};
pub use replica::{ClosedRound, DilocoReplica, FragmentId, Member, Phase, Rejected, RoundReport};
pub use replica_hook::{run_replica, split_recipe, ReplicaOptions, ReplicaOutcome};
pub use store::{open_store, Keys, RetryingStore};
