//! Advantage estimators on plain `f64` slices (outcome rewards, one per completion).
//!
//! Completions come in contiguous groups of `group_size` (all completions of one prompt
//! together), as TRL lays them out. Formulas (group g, reward r_i, length |o_i|, n = group size):
//!
//! | estimator | advantage |
//! |---|---|
//! | `grpo`, std `group` | (r_i − mean_g) / (std_g + 1e-4), std unbiased (TRL) |
//! | `grpo`, std `batch` | (r_i − mean_g) / (std_batch + 1e-4) (TRL) |
//! | `grpo`, std `none` | r_i − mean_g (Dr. GRPO) |
//! | `rloo` | n/(n−1) · (r_i − mean_g) = r_i − mean of the others (verl) |
//! | `reinforce_plus_plus` | whiten(r) over all tokens: (r_i − μ_tok) / sqrt(σ²_tok + 1e-8) (verl, γ = 1) |
//! | `reinforce_plus_plus_baseline` | whiten(r_i − mean_g) over all tokens (verl) |
//! | `opo` | r_i − Σ_g |o_j| r_j / Σ_g |o_j| (verl) |
//! | `grpo_passk` | best of the group: (r_max − r_second) / (std_g + ε); others 0 (verl) |
//! | `remax` | r_i − b_i, b_i the reward of the prompt's greedy completion (verl) |
use crate::{LossError, Result};
use serde::{Deserialize, Serialize};

/// Std scaling of group-relative advantages (TRL's `scale_rewards`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StdScaling {
    /// Divide by the group's std (+1e-4). TRL default.
    #[default]
    Group,
    /// Divide by the whole batch's std (+1e-4).
    Batch,
    /// No scaling.
    None,
}

/// Which advantage estimator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    /// Group-relative (TRL / GRPO).
    #[default]
    Grpo,
    /// Leave-one-out baseline.
    Rloo,
    /// REINFORCE++: batch whitening of the returns.
    ReinforcePlusPlus,
    /// REINFORCE++ with the group mean subtracted first.
    ReinforcePlusPlusBaseline,
    /// Optimal (length-weighted) baseline.
    Opo,
    /// verl's Pass@k: only each group's best completion gets an advantage.
    GrpoPassk,
    /// verl's ReMax: the reward of the prompt's greedy completion is the baseline (see
    /// [`compute_remax_advantages`]; [`compute_advantages`] refuses it).
    Remax,
}

/// How several reward functions combine (TRL's `multi_objective_aggregation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MultiRewardAggregation {
    /// Weighted sum of the rewards, then the estimator. TRL default.
    #[default]
    SumThenNormalize,
    /// Normalise each reward within its group (std + 1e-4), weighted sum, then normalise over
    /// the batch (GDPO; TRL).
    NormalizeThenSum,
}

/// What a group of a single completion gets from the group-relative estimator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SingletonGroup {
    /// Mean = its reward, std 0: advantage 0 (TRL). Default.
    #[default]
    ZeroAdvantage,
    /// Mean 0, std 1: advantage r / (1 + ε) (verl `compute_grpo_outcome_advantage`).
    MeanZeroStdOne,
}

/// Advantage configuration (TRL key names where TRL has them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdvantageConfig {
    /// Estimator. Default `grpo`.
    pub estimator: AdvantageEstimator,
    /// Std scaling for `grpo`. TRL default `group`.
    pub scale_rewards: StdScaling,
    /// Per-reward-function weights (default: all 1).
    pub reward_weights: Option<Vec<f64>>,
    /// Multi-reward aggregation. TRL default `sum_then_normalize`.
    pub multi_objective_aggregation: MultiRewardAggregation,
    /// Drop groups whose rewards all agree (DAPO dynamic sampling). Default false. A flag for
    /// the caller: apply [`filter_zero_variance_groups`] to the rewards before building the
    /// batch ([`compute_advantages`] itself keeps every completion).
    pub dynamic_sampling: bool,
    /// ε of (r − mean) / (std + ε). TRL 1e-4 (default); verl 1e-6.
    pub std_epsilon: f64,
    /// Groups of one completion. TRL `zero_advantage` (default); verl `mean_zero_std_one`.
    pub singleton_group: SingletonGroup,
}

impl AdvantageConfig {
    /// Check ranges (NaN fails every check); errors name the key. `std_epsilon` must be finite
    /// and > 0 (0 divides a group whose rewards all agree by 0: NaN advantages); every
    /// `reward_weights` entry finite, and with `num_reward_funcs` given, one weight per reward
    /// function.
    pub fn validate(&self, num_reward_funcs: Option<usize>) -> Result<()> {
        let e = self.std_epsilon;
        if !(e > 0.0 && e.is_finite()) {
            return Err(LossError::Config {
                key: "std_epsilon",
                message: format!("must be finite and > 0, got {e}"),
            });
        }
        if let Some(w) = &self.reward_weights {
            if let Some(x) = w.iter().find(|x| !x.is_finite()) {
                return Err(LossError::Config {
                    key: "reward_weights",
                    message: format!("every weight must be finite, got {x}"),
                });
            }
            if let Some(k) = num_reward_funcs {
                if w.len() != k {
                    return Err(LossError::Config {
                        key: "reward_weights",
                        message: format!("{} weights for {k} reward functions", w.len()),
                    });
                }
            }
        }
        Ok(())
    }
}

impl Default for AdvantageConfig {
    fn default() -> Self {
        Self {
            estimator: AdvantageEstimator::Grpo,
            scale_rewards: StdScaling::Group,
            reward_weights: None,
            multi_objective_aggregation: MultiRewardAggregation::SumThenNormalize,
            dynamic_sampling: false,
            std_epsilon: 1e-4,
            singleton_group: SingletonGroup::ZeroAdvantage,
        }
    }
}

impl AdvantageConfig {
    /// verl's values: std ε = 1e-6, a singleton group has mean 0 and std 1.
    pub fn verl() -> Self {
        Self {
            std_epsilon: 1e-6,
            singleton_group: SingletonGroup::MeanZeroStdOne,
            ..Self::default()
        }
    }
}

fn check_groups(n: usize, group_size: usize) -> Result<()> {
    if group_size == 0 || !n.is_multiple_of(group_size) {
        return Err(LossError::Input {
            field: "rewards",
            message: format!("{n} rewards do not split into groups of {group_size}"),
        });
    }
    Ok(())
}

fn check_finite(field: &'static str, xs: &[f64]) -> Result<()> {
    if let Some(i) = xs.iter().position(|x| !x.is_finite()) {
        return Err(LossError::Input {
            field,
            message: format!("value {} at index {i} is not finite", xs[i]),
        });
    }
    Ok(())
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Unbiased (Bessel-corrected) std; 0 for fewer than two values (TRL's `nanstd` would give
/// NaN there; TRL then uses 0 for a group of one).
fn std_unbiased(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return 0.0;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
}

/// TRL's group-relative advantages: (r − group mean) / (std + 1e-4) with `scale`.
pub fn group_advantages(rewards: &[f64], group_size: usize, scale: StdScaling) -> Result<Vec<f64>> {
    group_advantages_with(
        rewards,
        group_size,
        scale,
        1e-4,
        SingletonGroup::ZeroAdvantage,
    )
}

/// Group-relative advantages (r − mean_g) / (std + `eps`) with the framework's treatment of
/// single-completion groups (see [`SingletonGroup`]).
pub fn group_advantages_with(
    rewards: &[f64],
    group_size: usize,
    scale: StdScaling,
    eps: f64,
    singleton: SingletonGroup,
) -> Result<Vec<f64>> {
    check_groups(rewards.len(), group_size)?;
    check_finite("rewards", rewards)?;
    let batch_std = std_unbiased(rewards);
    let mut out = Vec::with_capacity(rewards.len());
    for g in rewards.chunks(group_size) {
        let verl_single = g.len() == 1 && singleton == SingletonGroup::MeanZeroStdOne;
        let m = if verl_single { 0.0 } else { mean(g) };
        let s = match scale {
            StdScaling::Group if verl_single => Some(1.0),
            StdScaling::Group => Some(std_unbiased(g)),
            StdScaling::Batch => Some(batch_std),
            StdScaling::None => None,
        };
        out.extend(g.iter().map(|r| match s {
            Some(s) => (r - m) / (s + eps),
            None => r - m,
        }));
    }
    Ok(out)
}

/// verl's RLOO: r_i·n/(n−1) − mean_g·n/(n−1) (= r_i − mean of the others); a group of one
/// keeps its reward.
pub fn rloo_advantages(rewards: &[f64], group_size: usize) -> Result<Vec<f64>> {
    check_groups(rewards.len(), group_size)?;
    check_finite("rewards", rewards)?;
    let mut out = Vec::with_capacity(rewards.len());
    for g in rewards.chunks(group_size) {
        let n = g.len() as f64;
        let m = mean(g);
        out.extend(g.iter().map(|r| {
            if g.len() > 1 {
                r * n / (n - 1.0) - m * n / (n - 1.0)
            } else {
                *r
            }
        }));
    }
    Ok(out)
}

/// verl's `masked_whiten` of per-sequence values repeated over each sequence's tokens:
/// token-weighted mean, unbiased token variance, (x − μ)/sqrt(σ² + 1e-8).
fn token_whiten(values: &[f64], lengths: &[usize]) -> Result<Vec<f64>> {
    let n_tok: f64 = lengths.iter().map(|&l| l as f64).sum();
    if n_tok < 2.0 {
        return Err(LossError::Input {
            field: "lengths",
            message: "REINFORCE++ whitening needs at least two completion tokens".into(),
        });
    }
    let mu = values
        .iter()
        .zip(lengths)
        .map(|(v, &l)| v * l as f64)
        .sum::<f64>()
        / (n_tok + 1e-8);
    let var = values
        .iter()
        .zip(lengths)
        .map(|(v, &l)| (v - mu).powi(2) * l as f64)
        .sum::<f64>()
        / (n_tok + 1e-8)
        * (n_tok / (n_tok - 1.0));
    Ok(values
        .iter()
        .map(|v| (v - mu) / (var + 1e-8).sqrt())
        .collect())
}

fn check_lengths(rewards: &[f64], lengths: &[usize]) -> Result<()> {
    if rewards.len() != lengths.len() {
        return Err(LossError::Input {
            field: "lengths",
            message: format!("{} lengths for {} rewards", lengths.len(), rewards.len()),
        });
    }
    Ok(())
}

/// verl's REINFORCE++ (γ = 1, outcome reward): the return equals the reward on every token of
/// the completion; advantages are the returns whitened over all active tokens of the batch:
/// A_i = (r_i − μ) / sqrt(σ² + 1e-8), μ = Σ|o_j| r_j / N, σ² = Σ|o_j|(r_j − μ)² / (N − 1),
/// N = Σ|o_j| (verl `masked_whiten`).
pub fn reinforce_plus_plus_advantages(rewards: &[f64], lengths: &[usize]) -> Result<Vec<f64>> {
    check_lengths(rewards, lengths)?;
    check_finite("rewards", rewards)?;
    token_whiten(rewards, lengths)
}

/// verl's REINFORCE++-baseline: subtract the group mean, then whiten over all active tokens:
/// A_i = whiten(r_i − mean_g(r)) with the token-weighted whitening of
/// [`reinforce_plus_plus_advantages`].
pub fn reinforce_plus_plus_baseline_advantages(
    rewards: &[f64],
    lengths: &[usize],
    group_size: usize,
) -> Result<Vec<f64>> {
    check_groups(rewards.len(), group_size)?;
    check_lengths(rewards, lengths)?;
    check_finite("rewards", rewards)?;
    let centred: Vec<f64> = rewards
        .chunks(group_size)
        .flat_map(|g| {
            let m = if g.len() > 1 { mean(g) } else { 0.0 };
            g.iter().map(move |r| r - m)
        })
        .collect();
    token_whiten(&centred, lengths)
}

/// verl's OPO: r_i − Σ_g |o_j| r_j / Σ_g |o_j| (length-weighted baseline).
pub fn opo_advantages(rewards: &[f64], lengths: &[usize], group_size: usize) -> Result<Vec<f64>> {
    check_groups(rewards.len(), group_size)?;
    check_lengths(rewards, lengths)?;
    check_finite("rewards", rewards)?;
    let mut out = Vec::with_capacity(rewards.len());
    for (g, l) in rewards.chunks(group_size).zip(lengths.chunks(group_size)) {
        let bsl = if g.len() > 1 {
            let wsum: f64 = l.iter().map(|&x| x as f64).sum();
            g.iter().zip(l).map(|(r, &x)| r * x as f64).sum::<f64>() / wsum.max(f64::MIN_POSITIVE)
        } else {
            0.0
        };
        out.extend(g.iter().map(|r| r - bsl));
    }
    Ok(out)
}

/// verl's `grpo_passk` (Pass@k, arXiv 2503.19595): in each group only the best completion gets
/// a non-zero advantage, r_max − r_second, divided by (std_g + `eps`) when `norm_by_std`
/// (unbiased std). Groups need at least two completions; ties go to the first maximum.
pub fn grpo_passk_advantages(
    rewards: &[f64],
    group_size: usize,
    norm_by_std: bool,
    eps: f64,
) -> Result<Vec<f64>> {
    check_groups(rewards.len(), group_size)?;
    check_finite("rewards", rewards)?;
    if group_size < 2 {
        return Err(LossError::Input {
            field: "group_size",
            message: "Pass@k needs at least 2 completions per group".into(),
        });
    }
    let mut out = vec![0.0; rewards.len()];
    for (gi, g) in rewards.chunks(group_size).enumerate() {
        let imax = (0..g.len()).fold(0, |b, k| if g[k] > g[b] { k } else { b });
        let second = (0..g.len())
            .filter(|&k| k != imax)
            .map(|k| g[k])
            .fold(f64::NEG_INFINITY, f64::max);
        let mut a = g[imax] - second;
        if norm_by_std {
            a /= std_unbiased(g) + eps;
        }
        out[gi * group_size + imax] = a;
    }
    Ok(out)
}

/// verl's ReMax: A_i = r_i − b_i, b_i the reward of the greedy completion of the same prompt
/// (`reward_baselines`, computed by the caller).
pub fn remax_advantages(rewards: &[f64], reward_baselines: &[f64]) -> Result<Vec<f64>> {
    check_finite("rewards", rewards)?;
    check_finite("reward_baselines", reward_baselines)?;
    if rewards.len() != reward_baselines.len() {
        return Err(LossError::Input {
            field: "reward_baselines",
            message: format!(
                "{} baselines for {} rewards",
                reward_baselines.len(),
                rewards.len()
            ),
        });
    }
    Ok(rewards
        .iter()
        .zip(reward_baselines)
        .map(|(r, b)| r - b)
        .collect())
}

/// Result of the DAPO dynamic-sampling filter.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DynamicSamplingResult {
    /// Indices of the groups kept.
    pub kept_groups: Vec<usize>,
    /// Per completion: whether its group is kept.
    pub keep: Vec<bool>,
    /// Fraction of groups dropped.
    pub fraction_dropped: f64,
}

/// DAPO's dynamic sampling: drop groups whose rewards have zero variance (all equal), since
/// their group-relative advantages are all zero. As verl's DAPO trainer (`filter_groups`:
/// keep iff `std(rewards) > 0 or len == 1`), a group of one completion is kept.
/// `fraction_dropped` = dropped groups / groups.
pub fn filter_zero_variance_groups(
    rewards: &[f64],
    group_size: usize,
) -> Result<DynamicSamplingResult> {
    check_groups(rewards.len(), group_size)?;
    check_finite("rewards", rewards)?;
    let mut kept_groups = Vec::new();
    let mut keep = Vec::with_capacity(rewards.len());
    let n_groups = rewards.len() / group_size;
    for (gi, g) in rewards.chunks(group_size).enumerate() {
        let k = g.len() == 1 || g.iter().any(|r| *r != g[0]);
        if k {
            kept_groups.push(gi);
        }
        keep.extend(std::iter::repeat_n(k, g.len()));
    }
    let fraction_dropped = if n_groups == 0 {
        0.0
    } else {
        1.0 - kept_groups.len() as f64 / n_groups as f64
    };
    Ok(DynamicSamplingResult {
        kept_groups,
        keep,
        fraction_dropped,
    })
}

/// Combine several reward functions and compute advantages.
///
/// `rewards_per_func[i][k]` is reward function k's score of completion i; `lengths[i]` its
/// completion length (for REINFORCE++ and OPO). With `sum_then_normalize` the weighted sum
/// goes through the configured estimator; with `normalize_then_sum` (TRL, GRPO only) each
/// reward is group-normalised (std + 1e-4), weighted, summed, and the sum is normalised over
/// the batch: (s − mean) / (std + 1e-4).
pub fn compute_advantages(
    cfg: &AdvantageConfig,
    rewards_per_func: &[Vec<f64>],
    lengths: &[usize],
    group_size: usize,
) -> Result<Vec<f64>> {
    if cfg.estimator == AdvantageEstimator::Remax {
        return Err(remax_needs_baselines());
    }
    let n = rewards_per_func.len();
    check_groups(n, group_size)?;
    let weights = reward_weights(cfg, rewards_per_func)?;
    match cfg.multi_objective_aggregation {
        MultiRewardAggregation::SumThenNormalize => {
            let summed = weighted_sums(rewards_per_func, &weights);
            match cfg.estimator {
                AdvantageEstimator::Grpo => group_advantages_with(
                    &summed,
                    group_size,
                    cfg.scale_rewards,
                    cfg.std_epsilon,
                    cfg.singleton_group,
                ),
                AdvantageEstimator::Rloo => rloo_advantages(&summed, group_size),
                AdvantageEstimator::ReinforcePlusPlus => {
                    reinforce_plus_plus_advantages(&summed, lengths)
                }
                AdvantageEstimator::ReinforcePlusPlusBaseline => {
                    reinforce_plus_plus_baseline_advantages(&summed, lengths, group_size)
                }
                AdvantageEstimator::Opo => opo_advantages(&summed, lengths, group_size),
                AdvantageEstimator::GrpoPassk => {
                    let norm_by_std = match cfg.scale_rewards {
                        StdScaling::Group => true,
                        StdScaling::None => false,
                        StdScaling::Batch => {
                            return Err(LossError::Config {
                                key: "scale_rewards",
                                message: "estimator `grpo_passk` normalises within the group \
                                          (verl `norm_adv_by_std_in_grpo`); allowed: \
                                          `group` or `none`, not `batch`"
                                    .into(),
                            })
                        }
                    };
                    grpo_passk_advantages(&summed, group_size, norm_by_std, cfg.std_epsilon)
                }
                AdvantageEstimator::Remax => Err(remax_needs_baselines()),
            }
        }
        MultiRewardAggregation::NormalizeThenSum => {
            let mut summed = vec![0.0; n];
            for (kk, w) in weights.iter().enumerate() {
                let col: Vec<f64> = rewards_per_func.iter().map(|r| r[kk]).collect();
                let norm = group_advantages(&col, group_size, StdScaling::Group)?;
                for (s, v) in summed.iter_mut().zip(norm) {
                    *s += w * v;
                }
            }
            let m = mean(&summed);
            let s = std_unbiased(&summed);
            Ok(summed.iter().map(|x| (x - m) / (s + 1e-4)).collect())
        }
    }
}

/// The per-reward-function weights (`reward_weights`, default all 1), checked against the
/// rows' width (every row must have the same number of rewards).
fn reward_weights(cfg: &AdvantageConfig, rewards_per_func: &[Vec<f64>]) -> Result<Vec<f64>> {
    let k = rewards_per_func.first().map_or(0, |r| r.len());
    if let Some(i) = rewards_per_func.iter().position(|r| r.len() != k) {
        return Err(LossError::Input {
            field: "rewards_per_func",
            message: format!(
                "row {i} has {} rewards, row 0 has {k}",
                rewards_per_func[i].len()
            ),
        });
    }
    let weights = cfg.reward_weights.clone().unwrap_or_else(|| vec![1.0; k]);
    if weights.len() != k {
        return Err(LossError::Config {
            key: "reward_weights",
            message: format!("{} weights for {k} reward functions", weights.len()),
        });
    }
    Ok(weights)
}

fn weighted_sums(rows: &[Vec<f64>], weights: &[f64]) -> Vec<f64> {
    rows.iter()
        .map(|r| r.iter().zip(weights).map(|(x, w)| x * w).sum())
        .collect()
}

/// verl's ReMax on several reward functions: the completions' rewards and their greedy
/// baselines' rewards (`baselines_per_func[i]`: reward function k's score of the greedy
/// completion of completion i's prompt) are combined with the same `reward_weights`, then
/// A_i = r_i − b_i ([`remax_advantages`]).
pub fn compute_remax_advantages(
    cfg: &AdvantageConfig,
    rewards_per_func: &[Vec<f64>],
    baselines_per_func: &[Vec<f64>],
) -> Result<Vec<f64>> {
    if cfg.multi_objective_aggregation != MultiRewardAggregation::SumThenNormalize {
        return Err(LossError::Config {
            key: "multi_objective_aggregation",
            message: "estimator `remax` combines rewards as `sum_then_normalize` only".into(),
        });
    }
    let weights = reward_weights(cfg, rewards_per_func)?;
    if baselines_per_func.len() != rewards_per_func.len()
        || baselines_per_func.iter().any(|b| b.len() != weights.len())
    {
        return Err(LossError::Input {
            field: "baselines_per_func",
            message: format!(
                "{} baseline rows for {} completions of {} reward functions each",
                baselines_per_func.len(),
                rewards_per_func.len(),
                weights.len()
            ),
        });
    }
    remax_advantages(
        &weighted_sums(rewards_per_func, &weights),
        &weighted_sums(baselines_per_func, &weights),
    )
}

fn remax_needs_baselines() -> LossError {
    LossError::Config {
        key: "estimator",
        message: "`remax` needs the rewards of the greedy baseline completions: call \
                  compute_remax_advantages"
            .into(),
    }
}
