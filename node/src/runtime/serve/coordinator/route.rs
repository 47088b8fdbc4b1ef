//! The coordinator's route table (seed SPEC 001 §4): the backends a
//! request may be served on, each with the fidelity the operator rates it
//! (`--fidelity`) and a per-token energy cost from what its meters recorded
//! over earlier serves on the same chain; the estimator's figure (the
//! chain's projected time per token at the estimator's power) only while
//! nothing was metered on it, and the table says which.

use std::collections::VecDeque;

use crate::runtime::serve::coordinator::runs::Run;

/// Chains whose metered costs are kept (the oldest is forgotten first).
pub const MAX_COSTED_CHAINS: usize = 64;
/// The estimator's time per layer and token where no plan projected one
/// (a chain of configured `--peer`s): a CPU decode of a small model.
pub(crate) const ESTIMATED_US_PER_LAYER: u64 = 1_000;

/// Energy the coordinator's meter recorded per chain.
#[derive(Debug, Default)]
pub(crate) struct RouteCosts {
    chains: VecDeque<(String, Spent)>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Spent {
    uj: u64,
    tokens: u64,
}

impl RouteCosts {
    /// A serve on `chain` cost `uj` for `tokens` tokens in and out.
    pub(crate) fn record(&mut self, chain: &str, uj: u64, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let at = match self.chains.iter().position(|(name, _)| name == chain) {
            Some(at) => at,
            None => {
                if self.chains.len() >= MAX_COSTED_CHAINS {
                    self.chains.pop_front();
                }
                self.chains.push_back((chain.to_string(), Spent::default()));
                self.chains.len() - 1
            }
        };
        let spent = &mut self.chains[at].1;
        spent.uj = spent.uj.saturating_add(uj);
        spent.tokens = spent.tokens.saturating_add(tokens);
    }

    /// Microjoules per token over every serve metered on `chain`, rounded
    /// up (a cost is never understated to zero).
    pub(crate) fn per_token(&self, chain: &str) -> Option<u64> {
        self.chains
            .iter()
            .find(|(name, _)| name == chain)
            .map(|(_, spent)| spent.uj.div_ceil(spent.tokens.max(1)).max(1))
    }
}

/// A backend's name: the chain's stage count (`local` for this node
/// alone) and its topology.
pub(crate) fn chain_name(run: &Run) -> String {
    let topology = &run.assigns[0].topology_hash;
    let topology = &topology[..topology.len().min(16)];
    match run.assigns.len() {
        1 => format!("local@{topology}"),
        stages => format!("split/{stages}@{topology}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_costs_what_was_metered_on_it_rounded_up_and_old_chains_are_forgotten() {
        let mut costs = RouteCosts::default();
        assert_eq!(costs.per_token("a"), None);
        costs.record("a", 1000, 3);
        assert_eq!(costs.per_token("a"), Some(334));
        costs.record("a", 2000, 7);
        assert_eq!(costs.per_token("a"), Some(300));
        costs.record("b", 5, 0);
        assert_eq!(
            costs.per_token("b"),
            None,
            "a serve of no tokens costs nothing per token"
        );
        for k in 0..MAX_COSTED_CHAINS {
            costs.record(&format!("c{k}"), 1, 1);
        }
        assert_eq!(costs.per_token("a"), None);
        assert_eq!(costs.chains.len(), MAX_COSTED_CHAINS);
    }
}
