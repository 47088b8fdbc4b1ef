//! The coordinator's route table (seed SPEC 001 §4): the backends a
//! request may be served on, each with the fidelity the operator rates it
//! (`--fidelity`) and a per-token energy cost from what its meters recorded
//! over earlier serves on the same chain; the estimator's figure (the
//! chain's projected time per token at the estimator's power) only while
//! nothing was metered on it, and the table says which.

use super::*;
use mesh_protocol::route::{Backend, CostBasis};

/// Chains whose metered costs are kept (the oldest is forgotten first).
pub(super) const MAX_COSTED_CHAINS: usize = 64;
/// The estimator's time per layer and token where no plan projected one
/// (a chain of configured `--peer`s): a CPU decode of a small model.
pub(super) const ESTIMATED_US_PER_LAYER: u64 = 1_000;

/// Energy the coordinator's meter recorded per chain.
#[derive(Debug, Default)]
pub(super) struct RouteCosts {
    chains: VecDeque<(String, Spent)>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Spent {
    uj: u64,
    tokens: u64,
}

impl RouteCosts {
    /// A serve on `chain` cost `uj` for `tokens` tokens in and out.
    pub(super) fn record(&mut self, chain: &str, uj: u64, tokens: u64) {
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
    pub(super) fn per_token(&self, chain: &str) -> Option<u64> {
        self.chains
            .iter()
            .find(|(name, _)| name == chain)
            .map(|(_, spent)| spent.uj.div_ceil(spent.tokens.max(1)).max(1))
    }
}

/// A backend's name: the chain's stage count and its topology.
pub(super) fn chain_name(run: &Run) -> String {
    let topology = &run.assigns[0].topology_hash;
    format!(
        "split/{}@{}",
        run.assigns.len(),
        &topology[..topology.len().min(16)]
    )
}

/// The backends a request on `run` is weighed over: the model this node
/// serves on the chain the planner (or the configured peers) gave.
pub(super) fn backends(inner: &Inner, run: &Run) -> Vec<Backend> {
    let name = chain_name(run);
    let metered = lock(&inner.route_costs).per_token(&name);
    let (uj_per_token, cost_basis) = match metered {
        Some(uj) => (uj, CostBasis::Metered),
        None => {
            let layers = u64::from(inner.model.config().layers);
            let us = run
                .projected_us
                .unwrap_or(layers.saturating_mul(ESTIMATED_US_PER_LAYER));
            let estimator = lock(&inner.steward).estimator();
            (
                estimator.estimate_uj(Duration::from_micros(us)),
                CostBasis::Estimator,
            )
        }
    };
    vec![Backend {
        name,
        recipe: coordinator::model_id(inner),
        fidelity: inner.fidelity,
        uj_per_token,
        uj_per_option_scored: 0,
        cost_basis,
    }]
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
