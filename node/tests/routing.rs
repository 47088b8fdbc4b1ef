//! Cheapest-sufficient routing on a live coordinator (seed SPEC 001 §4,
//! §3.2.1): the route table weighs the backend with its configured
//! fidelity and the per-token cost its meter recorded (the estimator's
//! only before any serve), the receipt carries the justification and both
//! fidelity figures, `verify` recomputes the table, and a request no
//! backend can serve within its floor or ceiling is refused before any
//! work, counted and journalled.

mod common;

use std::time::{Duration, Instant};

use common::nodes::{Setup, ask, pools_empty_within, receipt_of, request, synthetic, verify};
use mesh_node::runtime::serve::{GenerateRequest, RequestBounds};
use mesh_protocol::mesh1::Fidelity;
use serde_json::Value;

fn route_check(report: &Value) -> &Value {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["subject"] == "route table")
        .unwrap_or_else(|| panic!("no route table check: {report:#}"))
}

fn bounded(
    prompt: &str,
    max_tokens: usize,
    floor: Fidelity,
    ceiling: Option<u64>,
) -> GenerateRequest {
    GenerateRequest {
        bounds: RequestBounds {
            fidelity_floor: Some(floor),
            joule_ceiling_uj: ceiling,
        },
        ..request(prompt, max_tokens, None)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_router_weighs_measured_cost_and_fidelity_and_refuses_what_it_cannot_serve() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let b = Setup::stage(&model, dir.path(), "b", 2).start().await;
    let c = Setup::stage(&model, dir.path(), "c", 3).start().await;
    let mut a = Setup::coordinator(&model, dir.path(), vec![b.peer_addr(), c.peer_addr()]);
    a.fidelity = Fidelity::F3;
    let a = a.start().await;
    let coordinator = a.peer_addr();

    // Nothing metered yet: the estimator's figure, and the table says so.
    let first = ask(&coordinator, &bounded("route me", 4, Fidelity::F2, None))
        .await
        .unwrap();
    assert!(first.error.is_none(), "{:?}", first.error);
    let sealed = receipt_of(&first);
    assert!(
        sealed
            .route
            .contains("(estimator), the cheapest admissible of 1 weighed"),
        "{}",
        sealed.route
    );
    assert_eq!(sealed.fidelity_floor, Fidelity::F2);
    let fidelity = sealed.fidelity.expect("advertised and delivered");
    assert_eq!(
        (fidelity.advertised, fidelity.delivered),
        (Fidelity::F3, Fidelity::F3)
    );
    assert!(sealed.fidelity_met());
    let table = &first.bundle.as_ref().unwrap()["route"];
    assert_eq!(
        table["candidates"][0]["cost_basis"], "estimator",
        "{table:#}"
    );
    let (code, report) = verify(dir.path(), first.bundle.as_ref().unwrap());
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(route_check(&report)["ok"], true, "{report:#}");

    // Served once, the chain's cost is what the meter recorded per token.
    let second = ask(
        &coordinator,
        &bounded("route me again", 4, Fidelity::F0, None),
    )
    .await
    .unwrap();
    assert!(second.error.is_none(), "{:?}", second.error);
    let table = &second.bundle.as_ref().unwrap()["route"];
    assert_eq!(table["candidates"][0]["cost_basis"], "metered", "{table:#}");
    let first_receipt = receipt_of(&first);
    let per_token = first_receipt
        .energy
        .uj()
        .div_ceil(first_receipt.tokens_in + first_receipt.tokens_out);
    assert_eq!(table["backends"][0]["uj_per_token"], per_token, "{table:#}");

    // A table altered after the fact no longer recomputes to the receipt.
    let mut altered = second.bundle.clone().unwrap();
    altered["route"]["backends"][0]["uj_per_token"] = Value::from(per_token + 1);
    let (code, report) = verify(dir.path(), &altered);
    assert_eq!(code, 1, "{report:#}");
    assert_eq!(route_check(&report)["ok"], false, "{report:#}");

    // Above the rated fidelity, or over the ceiling: refused before any
    // work, with each backend's reason; counted and journalled.
    let since = Instant::now();
    let error = ask(&coordinator, &bounded("too fine", 4, Fidelity::F4, None))
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("below floor (F3 < F4)"), "{error}");
    let error = ask(&coordinator, &bounded("too dear", 4, Fidelity::F0, Some(1)))
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("over ceiling ("), "{error}");
    assert!(error.contains("uJ > 1 uJ)"), "{error}");
    let stats = a.stats().await;
    assert_eq!(stats.requests_refused_route, 2);
    assert_eq!(stats.requests_refused_other, 0);
    let nodes = [a, b, c];
    pools_empty_within(&nodes, since, Duration::from_secs(10), "after two refusals").await;

    // Cut short by its deadline, a serve delivers F0 (§3.2.1), so a floor
    // of F1 is not met, whatever the rating.
    let short = ask(
        &nodes[0].peer_addr(),
        &GenerateRequest {
            timeout: Some(Duration::from_millis(200)),
            ..bounded(
                "a long answer on a short deadline",
                1500,
                Fidelity::F1,
                None,
            )
        },
    )
    .await
    .unwrap();
    assert_eq!(short.terminal_state, "timed_out", "{short:?}");
    let sealed = receipt_of(&short);
    let fidelity = sealed.fidelity.unwrap();
    assert_eq!(
        (fidelity.advertised, fidelity.delivered),
        (Fidelity::F3, Fidelity::F0)
    );
    assert!(!sealed.fidelity_met());
    let (_, report) = verify(dir.path(), short.bundle.as_ref().unwrap());
    assert_eq!(route_check(&report)["ok"], true, "{report:#}");

    let data = dir.path().join("a").join("steward");
    for node in nodes {
        node.shutdown().await;
    }
    // The refusals are in the coordinator's journal, with the table digest.
    let inspect = std::process::Command::new(env!("CARGO_BIN_EXE_mesh-node"))
        .args(["journal", "inspect"])
        .arg(&data)
        .output()
        .unwrap();
    let journal = String::from_utf8_lossy(&inspect.stdout);
    assert_eq!(
        journal
            .matches("refused: none of 1 backends admissible")
            .count(),
        2,
        "{journal}"
    );
}
