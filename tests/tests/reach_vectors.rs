//! The committed `mesh-reach/1` vectors hold: every request, answer and
//! relay frame decodes, or is refused, as the file says.

use std::path::PathBuf;

use mesh_protocol::hex;
use mesh_protocol::reach::{ReachAnswer, ReachRequest, parse_relay_frame};
use serde_json::{Value, json};

fn vectors() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../vectors/mesh/reach.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn bytes(case: &Value, key: &str) -> Vec<u8> {
    hex::decode(case[key].as_str().unwrap()).unwrap()
}

fn request_json(request: &ReachRequest) -> Value {
    let name = request.name();
    match request {
        ReachRequest::Observe | ReachRequest::Relay => json!({ "request": name }),
        ReachRequest::Introduce { node } => json!({ "request": name, "node": hex::encode(node) }),
        ReachRequest::Punch { asker, at } => {
            json!({ "request": name, "asker": hex::encode(asker), "at": at.to_string() })
        }
        ReachRequest::DialBack { node, at } => {
            json!({ "request": name, "node": hex::encode(node), "at": at.to_string() })
        }
    }
}

#[test]
fn every_request_reads_as_the_vectors_say() {
    let v = vectors();
    let cases = v["requests"].as_array().unwrap();
    assert!(cases.len() > 100);
    for case in cases {
        let body = bytes(case, "body_hex");
        let expect = &case["expect"];
        match ReachRequest::decode(&body) {
            Ok(request) => {
                assert_eq!(&expect["ok"], &request_json(&request), "{}", case["name"]);
                assert_eq!(request.encode(), body, "one encoding: {}", case["name"]);
            }
            Err(error) => assert_eq!(expect["refused"], error.kind(), "{}", case["name"]),
        }
    }
}

#[test]
fn every_answer_reads_as_the_vectors_say_for_its_request() {
    let v = vectors();
    for case in v["answers"].as_array().unwrap() {
        let request = ReachRequest::decode(&bytes(case, "request_hex")).unwrap();
        let body = bytes(case, "body_hex");
        let expect = &case["expect"];
        match ReachAnswer::decode(&request, &body) {
            Ok(answer) => {
                assert_eq!(expect["ok"]["answer"], answer.name(), "{}", case["name"]);
                if let ReachAnswer::Observed { reachable, seen } = answer {
                    assert_eq!(expect["ok"]["reachable"], reachable);
                    assert_eq!(expect["ok"]["seen"], seen.to_string());
                }
                assert_eq!(answer.encode(), body, "one encoding: {}", case["name"]);
            }
            Err(error) => assert_eq!(expect["refused"], error.kind(), "{}", case["name"]),
        }
    }
}

#[test]
fn every_relay_frame_reads_as_the_vectors_say() {
    let v = vectors();
    for case in v["relay_frames"].as_array().unwrap() {
        let frame = bytes(case, "frame_hex");
        let expect = &case["expect"];
        match parse_relay_frame(&frame) {
            Ok((peer, packet)) => {
                assert_eq!(expect["ok"]["peer"], hex::encode(&peer), "{}", case["name"]);
                assert_eq!(
                    expect["ok"]["packet"],
                    hex::encode(packet),
                    "{}",
                    case["name"]
                );
            }
            Err(error) => assert_eq!(expect["refused"], error.kind(), "{}", case["name"]),
        }
    }
}
