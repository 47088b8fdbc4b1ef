//! Drafts for speculative decoding when the coordinator holds no draft
//! model: prompt lookup. The tokens that followed the latest earlier
//! occurrence of the text's last few tokens are proposed as what follows
//! them now. Text that repeats what it has read or written (code, quotes,
//! lists, a model's own loops) is drafted well; elsewhere nothing is
//! proposed and a decode step carries one token, as without drafting.
//! Greedy verification keeps only what the model would have chosen, so a
//! draft changes how many steps a generation takes, never its tokens.

/// How a draft is looked up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    /// The longest suffix looked for first.
    pub max_ngram: usize,
    /// The shortest suffix that may still propose.
    pub min_ngram: usize,
}

impl Default for Lookup {
    fn default() -> Self {
        Self {
            max_ngram: 3,
            min_ngram: 2,
        }
    }
}

/// Most tokens of history searched: a draft is looked up in the last
/// `MAX_LOOKUP_HISTORY` tokens only, so drafting costs a bounded time per
/// step however long the request.
pub const MAX_LOOKUP_HISTORY: usize = 8192;

impl Lookup {
    /// Up to `max` tokens to follow `history`: what followed the latest
    /// earlier occurrence of its longest suffix of `max_ngram` down to
    /// `min_ngram` tokens; empty when none recurs.
    pub fn propose(&self, history: &[u32], max: usize) -> Vec<u32> {
        let history = &history[history.len().saturating_sub(MAX_LOOKUP_HISTORY)..];
        if max == 0 {
            return Vec::new();
        }
        let len = history.len();
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if len <= n {
                continue;
            }
            let suffix = &history[len - n..];
            // The latest earlier occurrence: starts before the suffix's own.
            let found = (0..len - n)
                .rev()
                .find(|&start| &history[start..start + n] == suffix);
            if let Some(start) = found {
                let from = start + n;
                let to = (from + max).min(len);
                return history[from..to].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn proposes_what_followed_the_latest_occurrence_of_the_longest_suffix() {
        let lookup = Lookup::default();
        // "1 2 3 4 5 … 1 2 3 9 8 … 2 3" : the suffix [2 3] last recurred
        // before 9 8.
        let history = [1, 2, 3, 4, 5, 7, 1, 2, 3, 9, 8, 6, 2, 3];
        assert_eq!(lookup.propose(&history, 3), vec![9, 8, 6]);
        // A three-token suffix wins over a later two-token one.
        let history = [5, 2, 3, 4, 0, 2, 3, 7, 5, 2, 3];
        assert_eq!(lookup.propose(&history, 2), vec![4, 0]);
        // Cut at the history's end and at `max`.
        assert_eq!(lookup.propose(&[1, 2, 1, 2], 8), vec![1, 2]);
        assert_eq!(lookup.propose(&[1, 2, 1, 2], 1), vec![1]);
        assert_eq!(lookup.propose(&[1, 2, 1, 2], 0), Vec::<u32>::new());
    }

    #[test]
    fn proposes_nothing_when_nothing_recurs() {
        let lookup = Lookup::default();
        assert!(lookup.propose(&[], 4).is_empty());
        assert!(lookup.propose(&[7], 4).is_empty());
        assert!(lookup.propose(&[1, 2, 3, 4, 5, 6], 4).is_empty());
        // A single recurring token is below the default's two.
        assert!(lookup.propose(&[1, 9, 2, 9], 4).is_empty());
        let single = Lookup {
            max_ngram: 3,
            min_ngram: 1,
        };
        assert_eq!(single.propose(&[1, 9, 2, 9], 4), vec![2, 9]);
    }

    proptest! {
        /// A proposal is never longer than asked, and is what followed an
        /// earlier occurrence of the history's suffix.
        #[test]
        fn a_proposal_continues_an_earlier_occurrence(
            history in proptest::collection::vec(0u32..4, 0..64),
            max in 0usize..8,
        ) {
            let lookup = Lookup::default();
            let proposal = lookup.propose(&history, max);
            prop_assert!(proposal.len() <= max);
            if !proposal.is_empty() {
                let found = (lookup.min_ngram..=lookup.max_ngram).any(|n| {
                    history.len() > n && (0..history.len() - n).any(|start| {
                        history[start..start + n] == history[history.len() - n..]
                            && history[start + n..].starts_with(&proposal)
                    })
                });
                prop_assert!(found);
            }
        }
    }
}
