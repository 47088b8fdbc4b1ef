//! What a resumed request keeps: the caches of the stages that stayed.

/// Which caches a resumed segment keeps from the segment it carries on:
/// the remote stages from `from` on (the same node on the same layers, not
/// lost), and the coordinator's own when its layers stayed. Each holds
/// `positions` (the prompt and every token but the last); the stages
/// before `from` rebuild theirs by a replay of those positions, which the
/// last of them sends no further, and the last token runs as a decode step.
#[derive(Debug, Clone)]
pub(crate) struct KeepPlan {
    pub(crate) from: u32,
    pub(crate) own: bool,
    pub(crate) positions: usize,
    /// The nodes that keep their cache, for the records.
    pub(crate) nodes: Vec<[u8; 32]>,
}

/// Most bytes of its own slice's outputs the coordinator keeps per request,
/// to replay them to a new stage after a loss instead of recomputing its
/// own layers; a longer request recomputes.
pub const MAX_KEPT_OUTPUT_BYTES: usize = 64 << 20;

/// The first remote stage of `next` from which on every stage is the same
/// node on the same layers as in `interrupted` and was not lost: those keep
/// their caches. `next.len()` when the final stage changed.
pub(crate) fn kept_from(
    interrupted: &[([u8; 32], (u32, u32))],
    next: &[([u8; 32], (u32, u32))],
    lost: &[[u8; 32]],
) -> u32 {
    let n = next.len();
    let same = |k: usize| {
        interrupted.len() == n && interrupted[k] == next[k] && !lost.contains(&next[k].0)
    };
    (1..n).rev().find(|&k| !same(k)).map_or(1, |k| k + 1) as u32
}

#[cfg(test)]
mod tests {
    use super::kept_from;

    #[test]
    fn stages_after_the_last_that_changed_keep_their_caches() {
        let (c, a, b, spare) = ([0; 32], [1; 32], [2; 32], [3; 32]);
        let old = [(c, (0, 2)), (a, (2, 4)), (b, (4, 6))];
        // The middle lost, the spare on its layers: the final stage keeps.
        let next = [(c, (0, 2)), (spare, (2, 4)), (b, (4, 6))];
        assert_eq!(kept_from(&old, &next, &[a]), 2);
        // The final stage lost: nothing remote keeps.
        let next = [(c, (0, 2)), (a, (2, 4)), (spare, (4, 6))];
        assert_eq!(kept_from(&old, &next, &[b]), 3);
        // The same chain after a failure without a loss: every stage keeps.
        assert_eq!(kept_from(&old, &old, &[]), 1);
        // The same node on other layers rebuilds, and so does every stage
        // before it.
        let next = [(c, (0, 2)), (spare, (2, 5)), (b, (5, 6))];
        assert_eq!(kept_from(&old, &next, &[a]), 3);
        // A node that left and came back under its key is not trusted with
        // the cache it had.
        assert_eq!(kept_from(&old, &old, &[b]), 3);
        // Another stage count: nothing remote keeps.
        let next = [(c, (0, 4)), (b, (4, 6))];
        assert_eq!(kept_from(&old, &next, &[a]), 2);
    }
}
