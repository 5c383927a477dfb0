//! Policy versions: which weights produced which tokens.

use serde::{Deserialize, Serialize};

/// Number of weight updates the policy has had: the trainer publishes version `v + 1` after
/// its `v + 1`-th update. A resumed run starts from the checkpoint's version.
pub type PolicyVersion = u64;

/// An item the controller can age: a trajectory (or a whole GRPO group, if the trainer wants
/// groups dropped together) that knows the oldest policy version behind any of its tokens.
///
/// Staleness of an item consumed by a trainer holding version `v` is
/// `v - oldest_policy_version()`; the controller drops items whose staleness exceeds the bound.
pub trait Versioned {
    /// Oldest policy version that produced any token of this item.
    fn oldest_policy_version(&self) -> PolicyVersion;
}

/// One contiguous run of completion tokens produced by one policy version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionSegment {
    /// Index of the segment's first completion token.
    pub start_token: usize,
    /// Policy version that produced the tokens from `start_token` up to the next segment.
    pub policy_version: PolicyVersion,
}

/// Per-segment policy versions of one rollout. In async mode a rollout may pick up newer
/// weights between decode chunks (see `GenerateContext::newer_weights`); each switch starts a
/// segment, so per-token versions are recoverable without storing one number per token.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionSegments {
    segments: Vec<VersionSegment>,
}

impl VersionSegments {
    /// A rollout produced entirely by `policy_version`.
    pub fn single(policy_version: PolicyVersion) -> Self {
        Self {
            segments: vec![VersionSegment {
                start_token: 0,
                policy_version,
            }],
        }
    }

    /// Records that tokens from `start_token` on were produced by `policy_version`. A call
    /// with the current version, or at the same `start_token` as the last segment, updates in
    /// place instead of adding an empty segment.
    pub fn record(&mut self, start_token: usize, policy_version: PolicyVersion) {
        match self.segments.last_mut() {
            Some(last) if last.policy_version == policy_version => {}
            Some(last) if last.start_token == start_token => last.policy_version = policy_version,
            _ => self.segments.push(VersionSegment {
                start_token,
                policy_version,
            }),
        }
    }

    /// The segments, in token order.
    pub fn segments(&self) -> &[VersionSegment] {
        &self.segments
    }

    /// Version that produced completion token `token` (None before any segment).
    pub fn version_of_token(&self, token: usize) -> Option<PolicyVersion> {
        let idx = self.segments.partition_point(|s| s.start_token <= token);
        idx.checked_sub(1).map(|i| self.segments[i].policy_version)
    }

    /// Oldest version among the segments (None when empty).
    pub fn oldest(&self) -> Option<PolicyVersion> {
        self.segments.iter().map(|s| s.policy_version).min()
    }

    /// Newest version among the segments (None when empty).
    pub fn newest(&self) -> Option<PolicyVersion> {
        self.segments.iter().map(|s| s.policy_version).max()
    }
}

impl Versioned for VersionSegments {
    /// An empty record counts as version 0 (the oldest possible), so it is never mistaken for
    /// fresh data.
    fn oldest_policy_version(&self) -> PolicyVersion {
        self.oldest().unwrap_or(0)
    }
}

impl<T: Versioned> Versioned for Vec<T> {
    /// A group is as old as its oldest member (an empty group counts as version 0).
    fn oldest_policy_version(&self) -> PolicyVersion {
        self.iter()
            .map(Versioned::oldest_policy_version)
            .min()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_track_token_versions() {
        let mut s = VersionSegments::single(3);
        s.record(0, 3);
        s.record(10, 3); // same version: no new segment
        s.record(16, 4);
        s.record(32, 5);
        assert_eq!(s.segments().len(), 3);
        assert_eq!(s.version_of_token(0), Some(3));
        assert_eq!(s.version_of_token(15), Some(3));
        assert_eq!(s.version_of_token(16), Some(4));
        assert_eq!(s.version_of_token(100), Some(5));
        assert_eq!(s.oldest_policy_version(), 3);
        assert_eq!(s.newest(), Some(5));
        // A switch before any token of the segment was produced replaces it.
        s.record(32, 6);
        assert_eq!(s.segments().len(), 3);
        assert_eq!(s.version_of_token(40), Some(6));
        assert_eq!(VersionSegments::default().oldest_policy_version(), 0);
        assert_eq!(
            vec![s.clone(), VersionSegments::single(1)].oldest_policy_version(),
            1
        );
    }
}
