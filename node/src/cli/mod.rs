//! The commands' logic: serve, generate, demo and grants (`node_cli`), the
//! in-process engine commands (`engine_cli`), the real model's download
//! (`models`), offline verification (`verify`), human-readable output
//! (`render`), and the mesh as an observer sees it (`mesh_cli`).

pub mod args;
pub mod chat;
pub mod commands;
pub mod engine_cli;
pub mod inspect;
pub mod log;
pub mod mesh_cli;
pub mod models;
pub mod node_cli;
pub mod progress;
pub mod render;
pub mod replay;
pub mod verify;
pub mod weights;
