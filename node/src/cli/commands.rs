//! Each command of the line: the runtime's or a tool's work, and what it
//! prints. `main` parses the line and hands it to [`run`].

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;

use crate::cli::args::{
    BenchTarget, Cli, Command, DecideArgs, GenerateArgs, GrantAction, JournalAction, LogAction,
    MeshAction, ModelsAction, ReplayArgs, StatsArgs, StewardAction, VectorsAction, VerifyArgs,
    WeightsAction, WeightsTarget,
};

/// `--io-threads`, set once before any runtime starts.
static IO_THREADS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();

/// Run the command the line asks for.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let _ = IO_THREADS.set(cli.io_threads.map(usize::from));
    init_logging(&cli.command);
    match cli.command {
        Command::Verify(args) => match args.change_record.clone() {
            Some(record) => verify_coverage(args, record),
            None => Ok(crate::cli::verify::verify(
                &args.file,
                args.prev.as_deref(),
                args.json,
            )),
        },
        Command::Weights { action } => weights(action),
        Command::Replay(args) => replay(args),
        Command::Journal { action } => journal(action),
        Command::Steward { action } => steward(action),
        Command::Bench { target } => bench(target),
        Command::Demo(args) => {
            let ok = runtime()?.block_on(crate::cli::node_cli::demo(args))?;
            Ok(if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Command::Serve(args) => {
            let options = crate::cli::node_cli::node_options(*args)?;
            runtime()?.block_on(crate::cli::node_cli::serve(options))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Join(args) => {
            let options = crate::cli::node_cli::join_options(*args)?;
            runtime()?.block_on(crate::cli::node_cli::serve(options))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Mesh { action } => mesh(action),
        Command::Plan(args) => {
            let (report, text) = runtime()?.block_on(crate::cli::mesh_cli::plan(&args))?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{text}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Chat(args) => {
            crate::cli::chat::run(
                &crate::cli::chat::ChatOptions {
                    api: args.api,
                    system: args.system,
                    max_tokens: args.max_tokens,
                    temperature: args.temperature,
                },
                std::io::stdin().lock(),
                &mut std::io::stdout(),
            )?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Generate(args) => match args.coordinator.clone() {
            Some(coordinator) => generate_remote(args, coordinator),
            None => generate_local(args),
        },

        Command::Decide(args) => decide(args),
        Command::Stats(args) => stats(args),
        Command::Grant { action } => grant(action),
        Command::Keygen { out } => keygen(out),
        Command::Log { action } => log(action),
        Command::Vectors { action } => vectors(action),
        Command::Models { action } => models(action),
    }
}

fn models(action: ModelsAction) -> anyhow::Result<ExitCode> {
    match action {
        ModelsAction::List { json } => {
            let rows = crate::cli::models::list();
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                print!("{}", crate::cli::models::render_list(&rows));
            }
            Ok(ExitCode::SUCCESS)
        }
        ModelsAction::Pull { name } => {
            let known = crate::cli::models::known(&name).with_context(|| {
                format!(
                    "{name} is not a model this project knows ({}): `mesh-node models list` shows them",
                    crate::cli::models::KNOWN.map(|m| m.name).join(", ")
                )
            })?;
            let path = crate::cli::models::fetch(&known)?;
            println!("{}", path.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn journal(action: JournalAction) -> anyhow::Result<ExitCode> {
    match action {
        JournalAction::AcceptLoss { data, key } => {
            let key = crate::runtime::keys::load(&key)?;
            let (records, recorded) = crate::runtime::journal::Journal::accept_loss(
                &data.join("steward"),
                key,
                crate::runtime::clock::now_ms(),
            )?;
            match recorded {
                Some(record) => println!(
                    "recorded the loss as record {}: the journal holds {} records before it, and the node starts again",
                    record.seq,
                    records.len()
                ),
                None => println!("the journal lost nothing: nothing recorded"),
            }
            Ok(ExitCode::SUCCESS)
        }
        JournalAction::Inspect { dir } => {
            let (records, lost) = crate::runtime::journal::Journal::read_with_loss(&dir)?;
            let steward = crate::cli::inspect::steward_of(&records);
            // A lost tail is shown as the replay's failure: what remains
            // is printed, never passed as a whole journal.
            let replayed = match (&steward, &lost) {
                (_, Some(lost)) => Err(format!("{lost}")),
                (Some(did), None) => {
                    crate::runtime::steward::replay(did, &records).map_err(|e| e.to_string())
                }
                (None, None) => {
                    crate::runtime::steward::replay("", &records).map_err(|e| e.to_string())
                }
            };
            if let Some(did) = &steward {
                println!("steward {did}");
            }
            print!(
                "{}",
                crate::cli::inspect::render_journal(
                    &records,
                    replayed.as_ref().ok(),
                    replayed.as_ref().err().map(String::as_str)
                )
            );
            if let Some(lost) = &lost {
                eprintln!("mesh-node: {lost}");
            }
            Ok(if replayed.is_ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
    }
}

fn steward(action: StewardAction) -> anyhow::Result<ExitCode> {
    match action {
        StewardAction::ClearHalt { data, key, reason } => {
            if reason.trim().is_empty() {
                anyhow::bail!("give --reason: why grants may be honoured again (it is journalled)");
            }
            let key = crate::runtime::keys::load(&key)?;
            let mut steward = crate::runtime::steward::Steward::open(
                &data.join("steward"),
                key,
                Box::new(crate::runtime::energy::EstimatorMeter::default()),
            )?;
            let was = steward.clear_halt(&reason, crate::runtime::clock::now_ms())?;
            println!("the steward honours grants again; it had halted because: {was}");
            Ok(ExitCode::SUCCESS)
        }
        StewardAction::Open { receipt, key, json } => {
            let key = crate::runtime::keys::load(&key)?;
            crate::cli::replay::open(&receipt, &key, json)?;
            Ok(ExitCode::SUCCESS)
        }
        StewardAction::Exercise {
            key,
            data,
            serves,
            workload_ms,
            powercap,
        } => {
            let key = crate::runtime::keys::load(&key)?;
            let (meter, why) = crate::runtime::energy::select_meter(
                &powercap,
                crate::runtime::energy::EstimatorMeter::default(),
            );
            eprintln!("{why}");
            let mut stdout = std::io::stdout();
            crate::tools::exercise::run(
                &data,
                key,
                meter,
                serves,
                Duration::from_millis(workload_ms),
                &mut stdout,
            )?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn bench(target: BenchTarget) -> anyhow::Result<ExitCode> {
    match target {
        BenchTarget::Split {
            model,
            tokens,
            prompt_tokens,
            rounds,
            device,
            json,
        } => {
            let model = model.map_or_else(crate::cli::models::synthetic_model_path, Ok)?;
            let report = runtime()?.block_on(crate::tools::bench_split::bench_split(
                model,
                tokens,
                prompt_tokens,
                rounds,
                device,
            ))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", crate::tools::bench_split::render_split(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::Fold { seconds, json } => {
            let min_time = Duration::try_from_secs_f64(seconds)
                .context("--seconds must be a positive number")?;
            let measurements = crate::tools::bench::bench_fold(&[4096, 65_536], min_time);
            if json {
                println!("{}", serde_json::to_string_pretty(&measurements)?);
            } else {
                print!("{}", crate::tools::bench::render_fold(&measurements));
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::Api {
            model,
            tokens,
            rounds,
            json,
        } => {
            let model = bench_model(model)?;
            let report =
                runtime()?.block_on(crate::tools::bench_api::bench_api(&model, tokens, rounds))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", crate::tools::bench_api::render_api(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::Audit {
            model,
            tokens,
            requests,
            rates,
            rounds,
            json,
        } => {
            let model = bench_model(model)?;
            let report = runtime()?.block_on(crate::tools::bench_audit::bench_audit(
                &model, tokens, requests, rounds, &rates,
            ))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", crate::tools::bench_audit::render_audit(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::Concurrency {
            model,
            tokens,
            levels,
            llama_server,
            json,
        } => {
            let model = bench_model(model)?;
            let report =
                runtime()?.block_on(crate::tools::bench_concurrency::bench_concurrency(
                    &model,
                    tokens,
                    &levels,
                    llama_server,
                ))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!(
                    "{}",
                    crate::tools::bench_concurrency::render_concurrency(&report)
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::StageMemory {
            model,
            prompt_tokens,
            tokens,
            binary,
            json,
        } => {
            let model = bench_model(model)?;
            let report = runtime()?.block_on(crate::tools::bench_memory::bench_stage_memory(
                &model,
                prompt_tokens,
                tokens,
                binary.as_deref(),
            ))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!(
                    "{}",
                    crate::tools::bench_memory::render_stage_memory(&report)
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::Engine {
            model,
            prompt_tokens,
            decode_tokens,
            device,
            json,
        } => {
            let model = bench_model(model)?;
            let report =
                crate::tools::bench::bench_engine(&model, prompt_tokens, decode_tokens, device)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", crate::tools::bench::render_engine(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::Wan {
            model,
            rtt_ms,
            stages,
            jitter_ms,
            loss_percent,
            tokens,
            rounds,
            seed,
            draft_tokens,
            draft_model,
            prompt,
            json,
        } => {
            let bench = crate::tools::bench_wan::WanBench {
                draft_tokens,
                draft_model,
                prompt,
                model: bench_model(model)?,
                rtts_ms: rtt_ms,
                stages,
                jitter_ms,
                loss: loss_percent / 100.0,
                tokens,
                rounds,
                seed,
            };
            let report = runtime()?.block_on(crate::tools::bench_wan::bench_wan(&bench))?;
            if json {
                println!("{report}");
            } else {
                print!("{}", crate::tools::bench_wan::render_wan(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::Plan {
            members,
            layers,
            rounds,
            seed,
            json,
        } => {
            let report =
                crate::tools::bench_mesh::bench_plan(&crate::tools::bench_mesh::PlanBench {
                    members,
                    layers,
                    rounds,
                    seed,
                })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", crate::tools::bench_mesh::render_plan(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::Join {
            model,
            rounds,
            json,
        } => {
            let model = bench_model(model)?;
            let report =
                runtime()?.block_on(crate::tools::bench_mesh::bench_join(&model, rounds))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", crate::tools::bench_mesh::render_join(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::Resume {
            model,
            rounds,
            context,
            json,
        } => {
            let model = bench_model(model)?;
            let report = runtime()?.block_on(crate::tools::bench_mesh::bench_resume(
                &model, rounds, context,
            ))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", crate::tools::bench_mesh::render_resume(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::Kernels { json } => {
            let report = crate::tools::bench::bench_kernels()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", crate::tools::bench::render_kernels(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::Steward { serves, dir, json } => {
            let scratch;
            let dir = match dir {
                Some(dir) => dir,
                None => {
                    scratch = std::env::temp_dir()
                        .join(format!("mesh-node-bench-steward-{}", std::process::id()));
                    let _ = std::fs::remove_dir_all(&scratch);
                    scratch.clone()
                }
            };
            let report = crate::tools::bench::bench_steward(&dir, serves)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", crate::tools::bench::render_steward(&report));
            }
            let _ = std::fs::remove_dir_all(&dir);
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn mesh(action: MeshAction) -> anyhow::Result<ExitCode> {
    match action {
        MeshAction::Status { observe, json } => {
            let observed = runtime()?.block_on(crate::cli::mesh_cli::observe(&observe))?;
            if let Some(line) = observed.unreached(&observe) {
                eprintln!("mesh-node mesh status: {line}");
                return Ok(ExitCode::from(1));
            }
            let members = observed.members;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&crate::runtime::planner::members_json(&members))?
                );
            } else {
                print!("{}", crate::runtime::planner::render_members(&members));
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn grant(action: GrantAction) -> anyhow::Result<ExitCode> {
    match action {
        GrantAction::Issue {
            key,
            subject,
            budget_uj,
            expires_in_s,
            max_cost_uj,
            model_in,
            out,
        } => {
            let id = crate::cli::node_cli::grant_issue(
                &key,
                &subject,
                budget_uj,
                Duration::from_secs(expires_in_s),
                (max_cost_uj, &model_in),
                &out,
            )?;
            println!(
                "grant {id} ({budget_uj} µJ to {subject}) written to {}",
                out.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        GrantAction::Shard {
            grant,
            key,
            coordinator,
            out,
        } => {
            let shares = runtime()?.block_on(crate::cli::node_cli::grant_shard(
                &grant,
                &key,
                &coordinator,
                &out,
            ))?;
            for (steward, budget) in &shares {
                println!("  {budget} µJ held by {steward}");
            }
            println!("{} shards written to {}", shares.len(), out.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn vectors(action: VectorsAction) -> anyhow::Result<ExitCode> {
    match action {
        VectorsAction::Write { dir } => {
            let changed = crate::tools::vectors::write_or_check(&dir, false)?;
            println!(
                "wrote {} changed file(s) under {}",
                changed.len(),
                dir.display()
            );
            for file in changed {
                println!("  {file}");
            }
            Ok(ExitCode::SUCCESS)
        }
        VectorsAction::Check { dir } => {
            let differing = crate::tools::vectors::write_or_check(&dir, true)?;
            if differing.is_empty() {
                println!("vectors under {} are up to date", dir.display());
                Ok(ExitCode::SUCCESS)
            } else {
                eprintln!(
                    "vectors under {} differ from the generator; run `mesh-node vectors write`:",
                    dir.display()
                );
                for file in differing {
                    eprintln!("  {file}");
                }
                Ok(ExitCode::from(1))
            }
        }
    }
}

fn verify_coverage(args: VerifyArgs, change_record: PathBuf) -> anyhow::Result<ExitCode> {
    let VerifyArgs {
        json, file, prev, ..
    } = args;

    if prev.is_some() {
        anyhow::bail!("--prev checks a chain link, --change-record coverage: give one");
    }
    // Exit 1 means not covered: input that cannot be read is 2.
    let read = crate::cli::verify::read_receipt(&file)
        .map_err(anyhow::Error::msg)
        .and_then(|receipt| Ok((receipt, crate::cli::weights::read_record(&change_record)?)));
    let (receipt, record) = match read {
        Ok(read) => read,
        Err(error) => {
            eprintln!("mesh-node verify: {error:#}");
            return Ok(ExitCode::from(2));
        }
    };
    let covered = crate::cli::weights::coverage(&receipt, &record);
    if json {
        println!(
            "{}",
            match &covered {
                Ok(value) => value.clone(),
                Err(why) => serde_json::json!({ "covered": false, "why": why }),
            }
        );
    } else {
        match &covered {
            Ok(value) => println!(
                "covered: receipt {} was served on weights entry #{} ({})",
                receipt.receipt.sequence, value["by"]["seq"], value["by"]["reason"]
            ),
            Err(why) => println!("NOT covered: {why}"),
        }
    }
    Ok(if covered.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn replay(args: ReplayArgs) -> anyhow::Result<ExitCode> {
    let ReplayArgs {
        bundle,
        model,
        prompt_file,
        chat,
        opening,
        output_file,
        device,
        json,
        tape,
    } = args;
    let replayed = match (tape, prompt_file) {
        (Some(tape), _) => crate::cli::replay::replay_tape(&bundle, &model, &tape, device, json),
        (None, Some(prompt_file)) => crate::cli::replay::replay(&crate::cli::replay::ReplayArgs {
            bundle: &bundle,
            model: &model,
            prompt_file: &prompt_file,
            chat,
            opening: opening.as_deref(),
            output_file: output_file.as_deref(),
            device,
            json,
        }),
        (None, None) => Err(anyhow::anyhow!("give --prompt-file, or --tape")),
    };
    // Exit 1 means diverged: input that cannot be read is 2.
    Ok(replayed.unwrap_or_else(|error| {
        eprintln!("mesh-node replay: {error:#}");
        ExitCode::from(2)
    }))
}

fn generate_remote(args: GenerateArgs, coordinator: String) -> anyhow::Result<ExitCode> {
    let GenerateArgs {
        prompt,
        max_tokens,
        chat,
        temperature,
        top_k,
        top_p,
        seed,
        out,
        format,
        json,
        shards,
        grant_key,
        ceiling_uj,
        fidelity_floor,
        timeout_ms,
        ..
    } = args;

    let format = crate::cli::node_cli::BundleFormat::parse(&format)?;
    let grant = match (shards, grant_key) {
        (Some(shards), Some(holder)) => {
            // The prompt-token figure is the requester's own estimate (seed 001 §2.3).
            let estimate = u32::try_from(prompt.len().div_ceil(4)).unwrap_or(u32::MAX);
            let mut serve = crate::runtime::serve::GrantedServe::derive(
                &prompt,
                max_tokens,
                estimate,
                ceiling_uj.unwrap_or(50_000_000),
            );
            if let Some(floor) = fidelity_floor {
                serve.fidelity_floor = floor;
            }
            let presentations = crate::cli::node_cli::presentations_for(&shards, &holder, &serve)?;
            Some(crate::runtime::serve::GrantedServe {
                serve,
                presentations,
            })
        }
        _ => None,
    };
    let request = crate::runtime::serve::GenerateRequest {
        prompt,
        max_tokens,
        chat,
        sampling: mesh_stage::sampling::SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        },
        grant,
        timeout: timeout_ms.map(std::time::Duration::from_millis),
        stop: Vec::new(),
        bounds: crate::runtime::serve::RequestBounds {
            fidelity_floor,
            joule_ceiling_uj: ceiling_uj,
        },
        decision: None,
    };
    let summary = runtime()?.block_on(crate::cli::node_cli::generate_via(
        &coordinator,
        request,
        out.as_deref().map(|path| (path, format)),
        json,
    ))?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "text": summary.text, "terminal_state": summary.terminal_state, "error": summary.error, "details": summary.details,
            }))?
        );
    }
    if let Some(error) = &summary.error {
        eprintln!(
            "mesh-node: the request ended early ({}): {error}",
            summary.terminal_state
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

fn generate_local(args: GenerateArgs) -> anyhow::Result<ExitCode> {
    let GenerateArgs {
        model,
        prompt,
        max_tokens,
        chat,
        split,
        temperature,
        top_k,
        top_p,
        seed,
        wire,
        json,
        ..
    } = args;

    let wire =
        mesh_stage::frame::WireDType::parse(&wire).context("--wire must be f32, f16 or bf16")?;
    crate::cli::engine_cli::generate(&crate::cli::engine_cli::GenerateOptions {
        model,
        prompt,
        max_tokens,
        chat,
        split,
        sampling: mesh_stage::sampling::SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        },
        wire,
        json,
    })?;
    Ok(ExitCode::SUCCESS)
}

fn decide(args: DecideArgs) -> anyhow::Result<ExitCode> {
    let DecideArgs {
        coordinator,
        prompt,
        question,
        options,
        chat,
        fidelity_floor,
        ceiling_uj,
        timeout_ms,
        out,
        json,
        ..
    } = args;

    let request = crate::runtime::serve::GenerateRequest {
        chat,
        timeout: timeout_ms.map(std::time::Duration::from_millis),
        bounds: crate::runtime::serve::RequestBounds {
            fidelity_floor,
            joule_ceiling_uj: ceiling_uj,
        },
        decision: Some(mesh_protocol::control::DecisionAsk { question, options }),
        ..crate::runtime::serve::GenerateRequest::greedy(prompt, 1)
    };
    let summary = runtime()?.block_on(crate::cli::node_cli::generate_via(
        &coordinator,
        request,
        out.as_deref()
            .map(|path| (path, crate::cli::node_cli::BundleFormat::Mesh)),
        true,
    ))?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "chosen": summary.text,
                "terminal_state": summary.terminal_state,
                "error": summary.error,
                "decision": summary.details["decision"],
                "receipt": summary.details["receipt"],
            }))?
        );
    } else if summary.error.is_none() {
        println!("{}", summary.text);
        for option in summary.details["decision"]["options"]
            .as_array()
            .into_iter()
            .flatten()
        {
            println!(
                "  {}. {}  {:.4}",
                option["label"].as_str().unwrap_or_default(),
                option["option"].as_str().unwrap_or_default(),
                option["probability"].as_f64().unwrap_or_default()
            );
        }
    }
    if let Some(error) = &summary.error {
        eprintln!(
            "mesh-node: the decision ended early ({}): {error}",
            summary.terminal_state
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

fn stats(args: StatsArgs) -> anyhow::Result<ExitCode> {
    let StatsArgs {
        node,
        key,
        json,
        prometheus,
        ..
    } = args;

    let key = crate::runtime::keys::load(&key)?;
    let (node, stats) = runtime()?.block_on(async {
        let node = crate::runtime::client::peer_or_learn(&node).await?;
        let stats = crate::runtime::serve::node_stats_remote(&key, &node).await?;
        anyhow::Ok((node, stats))
    })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&stats)?);
    } else if prometheus {
        print!("{}", stats.prometheus());
    } else {
        print!("{}", crate::cli::render::node_stats(&node, &stats));
    }
    Ok(ExitCode::SUCCESS)
}

fn weights(action: WeightsAction) -> anyhow::Result<ExitCode> {
    let target = |t: WeightsTarget| crate::cli::weights::Target {
        data: t.data,
        key: t.key,
        backend: t.backend,
        model: t.model,
    };
    let (value, json) = match action {
        WeightsAction::Plan {
            target: t,
            precision,
            fidelity_floor,
            validation,
            foresees,
            risk_assessment,
            json,
        } => (
            crate::cli::weights::plan(
                &target(t),
                precision,
                fidelity_floor,
                validation,
                foresees,
                risk_assessment,
            )?,
            json,
        ),
        WeightsAction::Record {
            target: t,
            precision,
            fidelity,
            plan,
            validation_result,
            reason,
            json,
        } => (
            crate::cli::weights::record(
                &target(t),
                crate::cli::weights::Change {
                    precision,
                    fidelity,
                    plan,
                    validation_result,
                    reason,
                },
            )?,
            json,
        ),
        WeightsAction::Show {
            data,
            backend,
            out,
            json,
        } => {
            let records = crate::cli::weights::show(&data, backend.as_deref())?;
            if let Some(out) = out {
                let [record] = records.as_slice() else {
                    anyhow::bail!(
                        "--out writes one backend's record: {} found (give --backend)",
                        records.len()
                    );
                };
                std::fs::write(
                    &out,
                    serde_json::to_vec_pretty(&crate::cli::weights::record_document(record))?,
                )?;
            }
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &records
                            .iter()
                            .map(crate::cli::weights::record_document)
                            .collect::<Vec<_>>()
                    )?
                );
            } else {
                print!("{}", crate::cli::weights::render(&records));
            }
            return Ok(ExitCode::SUCCESS);
        }
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!(
            "recorded #{} ({}) for {}: id {}",
            value["seq"],
            value["kind"],
            value["backend"],
            value["id"].as_str().unwrap_or("")
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn log(action: LogAction) -> anyhow::Result<ExitCode> {
    let value = match action {
        LogAction::Show { data } => crate::cli::log::show(&data)?,
        LogAction::Prove { data, capsule_id } => crate::cli::log::prove(&data, &capsule_id)?,
        LogAction::Checkpoint { data, key } => {
            let key = crate::runtime::keys::load(&key)?;
            crate::cli::log::checkpoint(&data, &key)?
        }
    };
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(ExitCode::SUCCESS)
}

fn keygen(out: PathBuf) -> anyhow::Result<ExitCode> {
    let key = crate::runtime::keys::generate(&out)?;
    println!(
        "{}",
        mesh_protocol::identity::did_key(&key.verifying_key().to_bytes())
    );
    eprintln!(
        "wrote {} (keep it private: it is this node's identity)",
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = IO_THREADS.get().copied().flatten() {
        builder.worker_threads(threads);
    }
    builder
        .on_thread_start(crate::runtime::bind_gpu_to_this_thread)
        .on_thread_unpark(crate::runtime::bind_gpu_to_this_thread)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Logs go to stderr through `tracing`; `RUST_LOG` chooses what is shown.
/// By default a serving node says what it does (info), and every other
/// command only what went wrong (warn), so the demo's answer stays in view.
fn init_logging(command: &Command) {
    let default = match command {
        Command::Serve(_) | Command::Join(_) => "mesh_node=info",
        _ => "mesh_node=warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

/// The model a benchmark runs: the one given, else the default model.
fn bench_model(model: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    crate::cli::models::default_model(model)
}
