//! The one seed derivation of the crate: every random stream (prompt draws, sampling, env
//! resets, LoRA init and dropout) is seeded by `mix_seed(seed, step, index)`.

/// A seed that depends only on (seed, step, index): SplitMix64 over the three.
pub fn mix_seed(seed: u64, step: u64, index: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(step.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(index.wrapping_mul(0x94D0_49BB_1331_11EB))
        .wrapping_add(0x2545_F491_4F6C_DD1D);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
