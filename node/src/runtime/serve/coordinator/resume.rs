//! A request as segments: the chain it starts on, and the chains it goes
//! on over after losing a stage, keeping what caches it can.

use std::sync::Arc;

use anyhow::Context;
use mesh_protocol::block::ReturnMode;

use crate::runtime::serve::coordinator::admit::Admitted;
use crate::runtime::serve::coordinator::admit::Held;
use crate::runtime::serve::coordinator::admit::request_scope;
use crate::runtime::serve::coordinator::admit::route_or_refuse;
use crate::runtime::serve::coordinator::drive::Driven;
use crate::runtime::serve::coordinator::keep::KeepPlan;
use crate::runtime::serve::coordinator::keep::kept_from;
use crate::runtime::serve::coordinator::progress::Progress;
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use crate::runtime::serve::coordinator::runs::Run;

/// The caches a resume onto `next` can keep, if any: only with the direct
/// return (a relayed chain carries every step's reply back through every
/// stage), and only after a segment that produced a token (its stages then
/// built every position but the last: a segment that failed in its replay,
/// or before its first token, left them short).
pub(crate) fn keep_plan(
    coordinator: &CoordinatorRole,
    interrupted: &Run,
    next: &Run,
    admitted: &Admitted<'_>,
    driven: &Driven,
    progress: &Progress,
) -> Option<KeepPlan> {
    if coordinator.settings.return_mode != ReturnMode::Direct || driven.tokens == 0 {
        return None;
    }
    let positions = admitted.prompt_ids.len() + progress.tokens.len() - 1;
    let chain = |run: &Run| -> Vec<([u8; 32], (u32, u32))> {
        run.keys
            .iter()
            .zip(&run.assigns)
            .map(|(key, a)| (*key, (a.layer_start, a.layer_end)))
            .collect()
    };
    let (before, after) = (chain(interrupted), chain(next));
    let from = kept_from(&before, &after, &driven.lost);
    let own = before.first() == after.first()
        && Arc::ptr_eq(&interrupted.own.slice, &next.own.slice)
        && admitted
            .held
            .cache
            .as_ref()
            .is_some_and(|cache| cache.positions() >= positions)
        && progress
            .own_outputs
            .as_ref()
            .is_some_and(|out| out.len() >= positions * next.own.slice.config().hidden);
    // Every remote stage kept, the coordinator's own not: it would have to
    // rebuild its cache without sending anything. Rebuild everything.
    if (from as usize == next.keys.len() || from == 1) && !own {
        return None;
    }
    let nodes = own
        .then_some(next.keys[0])
        .into_iter()
        .chain(next.keys[from as usize..].iter().copied())
        .collect();
    Some(KeepPlan {
        from,
        own,
        positions,
        nodes,
    })
}

impl<'a> Admitted<'a> {
    /// The same request on a new chain: a new split key (its own lanes and
    /// records), a cache on the new own slice, a record slot, and the grant
    /// decisions of the new chain's nodes that hold a shard. The
    /// coordinator's own grant decision and the requester watch move over.
    pub(crate) async fn resume(
        &mut self,
        coordinator: &'a Arc<CoordinatorRole>,
        run: &Arc<Run>,
        keep: Option<KeepPlan>,
    ) -> anyhow::Result<Self> {
        // The new chain is another backend: weighed again, and refused as
        // any request is when it cannot serve within the bounds.
        let route = route_or_refuse(
            coordinator,
            run,
            &self.serve,
            self.route.model_in.as_deref(),
        )?;
        let capacity = self.prompt_ids.len() + self.max_new;
        // The own cache goes on under the new request, cut back to the
        // positions every kept stage holds.
        let kept = match keep.as_ref().filter(|keep| keep.own) {
            Some(keep) => {
                let mut lease = self.held.cache.take().context("the request's cache")?;
                lease.cache().truncate(keep.positions)?;
                Some(lease)
            }
            None => {
                // Its place in the pool (shared with the new run's when the
                // own layers stayed) is given back before a new one is taken.
                self.held.release_cache();
                None
            }
        };
        let (mut held, split_key) = Held::take_places(coordinator, run, capacity, kept)?;
        held.authorise_stages(run, &split_key, &self.serve, &self.shards)
            .await?;
        held.ticket = self.held.ticket.take();
        held.watcher = self.held.watcher.take();
        Ok(Self {
            request_id: split_key.request_id,
            held,
            scope: request_scope(coordinator, run, split_key),
            prompt_ids: self.prompt_ids.clone(),
            max_new: self.max_new,
            serve: self.serve.clone(),
            shards: self.shards.clone(),
            keep,
            resumes: Some(self.request_id),
            route,
            asked_tokens: self.asked_tokens,
            decision: self.decision.clone(),
        })
    }
}
