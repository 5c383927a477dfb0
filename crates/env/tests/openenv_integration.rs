//! The OpenEnv client against a real openenv-core 0.3.0 echo server (PROTOCOL.md).
//!
//! `OPENENV_URL` names the shared server (CI starts it with ../shared/openenv/start-server.sh);
//! the capacity / timeout / restart test starts its own server from `$OPENENV_VENV` with a
//! session cap of 1 so it can pause, stop and restart it. Unset variables: SKIPPED locally,
//! a failure under `CI`. Reference values are the echo env's own: reward = 0.1 × len(message),
//! reset observation "Echo Env environment ready!" (captured in PROTOCOL.md).

mod common;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::{free_port, service_var, Gauge, PyServer, ScriptedPolicy};
use composer_env::{
    run_episode, Env, EnvError, EnvPool, EpisodeConfig, EpisodeEnd, OpenEnvClient,
    OpenEnvClientConfig, PoolConfig, ResetOptions,
};
use serde_json::{json, Value};

fn fast_config() -> OpenEnvClientConfig {
    OpenEnvClientConfig {
        connect_retries: 12,
        initial_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(2),
        ..Default::default()
    }
}

#[tokio::test]
async fn http_endpoints_and_a_ws_episode() {
    let Some(url) = service_var("OPENENV_URL", "http_endpoints_and_a_ws_episode") else {
        return;
    };
    let client = OpenEnvClient::connect(&url, fast_config()).await.unwrap();
    client.health().await.unwrap();
    let meta = client.metadata().await.unwrap();
    assert_eq!(meta["name"], "EchoEnvironment");
    let schema = client.fetch_schema().await.unwrap();
    for key in ["action", "observation", "state"] {
        assert!(schema[key].is_object(), "/schema lacks `{key}`: {schema}");
    }
    let action = client.action_schema().unwrap();
    assert_eq!(action["required"], json!(["message"]));
    assert_eq!(action["additionalProperties"], json!(false));

    let mut env = client.session();
    let first = env.reset(ResetOptions::seeded(3)).await.unwrap();
    assert_eq!(
        first.observation["echoed_message"],
        "Echo Env environment ready!"
    );
    assert_eq!(first.text, "Echo Env environment ready!");
    assert_eq!(first.reward, Some(0.0));
    assert!(!first.done);
    for (k, msg) in ["hello", "composer-rl"].iter().enumerate() {
        let r = env.step(json!({"message": msg})).await.unwrap();
        assert_eq!(r.observation["echoed_message"], *msg);
        assert_eq!(r.observation["message_length"], msg.len());
        assert!((r.reward.unwrap() - 0.1 * msg.len() as f64).abs() < 1e-9);
        assert!(!r.done);
        let state = env.state().await.unwrap();
        assert_eq!(state["step_count"], k + 1);
        assert!(state["episode_id"].is_string());
    }
    // A second reset on the same session starts a fresh episode.
    env.reset(ResetOptions::default()).await.unwrap();
    assert_eq!(env.state().await.unwrap()["step_count"], 0);
    env.close().await.unwrap();
    assert!(!env.is_connected());
    match env.step(json!({"message": "late"})).await {
        Err(EnvError::NoSession(_)) => {}
        other => panic!("step after close: expected NoSession, got {other:?}"),
    }
}

#[tokio::test]
async fn error_codes_that_keep_the_session() {
    let Some(url) = service_var("OPENENV_URL", "error_codes_that_keep_the_session") else {
        return;
    };
    let client = OpenEnvClient::connect(&url, fast_config()).await.unwrap();
    let mut env = client.session();
    env.reset(ResetOptions::default()).await.unwrap();
    env.step(json!({"message": "ab"})).await.unwrap();

    // VALIDATION_ERROR: an action outside the schema, with pydantic's structured errors.
    match env.step(json!({"msg": "x"})).await {
        Err(EnvError::InvalidAction { errors, .. }) => {
            let kinds: Vec<&str> = errors
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|e| e["type"].as_str())
                .collect();
            assert_eq!(kinds, ["missing", "extra_forbidden"], "{errors}");
        }
        other => panic!("expected VALIDATION_ERROR, got {other:?}"),
    }
    // INVALID_JSON and UNKNOWN_TYPE, as the server reports them.
    match env.call_raw("not json").await {
        Err(EnvError::Server { code, message }) => {
            assert_eq!(code, "INVALID_JSON");
            assert!(message.starts_with("Invalid JSON"), "{message}");
        }
        other => panic!("expected INVALID_JSON, got {other:?}"),
    }
    match env.call_raw(r#"{"type":"bogus"}"#).await {
        Err(EnvError::Server { code, message }) => {
            assert_eq!(code, "UNKNOWN_TYPE");
            assert_eq!(message, "Unknown message type: bogus");
        }
        other => panic!("expected UNKNOWN_TYPE, got {other:?}"),
    }
    // All of these kept the session and its episode state: one successful step so far.
    assert!(env.is_connected());
    assert_eq!(env.state().await.unwrap()["step_count"], 1);
    let r = env.step(json!({"message": "abc"})).await.unwrap();
    assert!((r.reward.unwrap() - 0.3).abs() < 1e-9);
    assert_eq!(env.state().await.unwrap()["step_count"], 2);
    env.close().await.unwrap();
}

#[tokio::test]
async fn token_faithful_episode_against_the_real_echo_env() {
    let Some(url) = service_var(
        "OPENENV_URL",
        "token_faithful_episode_against_the_real_echo_env",
    ) else {
        return;
    };
    let client = OpenEnvClient::connect(&url, fast_config()).await.unwrap();
    let mut env = client.session();
    let mut policy = ScriptedPolicy::new(&["hi", r#"{"message": "four"}"#, "xyz!!"]);
    let cfg = EpisodeConfig {
        max_turns: 3,
        max_total_tokens: 4096,
    };
    let ep = run_episode(&mut policy, &mut env, ResetOptions::default(), &cfg)
        .await
        .unwrap();
    env.close().await.unwrap();
    assert_eq!(ep.end, EpisodeEnd::MaxTurns);
    assert_eq!(ep.turns.len(), 3);
    // Whole-text action for a plain answer, the JSON object when it fits the schema.
    assert_eq!(ep.turns[0].action, Some(json!({"message": "hi"})));
    assert_eq!(ep.turns[1].action, Some(json!({"message": "four"})));
    let rewards: Vec<f64> = ep.turns.iter().map(|t| t.reward).collect();
    for (r, want) in rewards.iter().zip([0.2, 0.4, 0.5]) {
        assert!((r - want).abs() < 1e-9, "{rewards:?}");
    }
    assert!((ep.total_reward - 1.1).abs() < 1e-9);
    assert!((ep.final_reward - 0.5).abs() < 1e-9);
    // The sequence: prompt (masked), then each model turn exactly as sampled (mask 1,
    // the sampler's log-probs, version 7) and the echoed observation (masked).
    let prompt = "Echo Env environment ready!";
    assert_eq!(ep.prompt_len, prompt.len());
    let lens = ep.token_ids.len();
    assert_eq!(ep.loss_mask.len(), lens);
    assert_eq!(ep.sampler_logprobs.len(), lens);
    let mut expect_ids: Vec<u32> = prompt.bytes().map(u32::from).collect();
    let mut expect_mask = vec![0u8; prompt.len()];
    let mut expect_lp = vec![0f32; prompt.len()];
    for (k, msg) in ["hi", r#"{"message": "four"}"#, "xyz!!"].iter().enumerate() {
        let turn = &ep.turns[k];
        assert_eq!(turn.model_tokens.start, expect_ids.len());
        expect_ids.extend(msg.bytes().map(u32::from));
        expect_mask.extend(std::iter::repeat_n(1u8, msg.len()));
        expect_lp.extend((0..msg.len()).map(ScriptedPolicy::logprob));
        let echoed = ["hi", "four", ""][k];
        assert_eq!(turn.observation_tokens.len(), echoed.len());
        expect_ids.extend(echoed.bytes().map(u32::from));
        expect_mask.extend(std::iter::repeat_n(0u8, echoed.len()));
        expect_lp.extend(std::iter::repeat_n(0.0, echoed.len()));
    }
    assert_eq!(ep.token_ids, expect_ids);
    assert_eq!(ep.loss_mask, expect_mask);
    assert_eq!(ep.sampler_logprobs, expect_lp);
    for (m, v) in ep.loss_mask.iter().zip(&ep.policy_versions) {
        assert_eq!(*v, if *m == 1 { 7 } else { 0 });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pool_bounds_concurrency_and_measures_latency() {
    let Some(url) = service_var(
        "OPENENV_URL",
        "pool_bounds_concurrency_and_measures_latency",
    ) else {
        return;
    };
    let client = OpenEnvClient::connect(&url, fast_config()).await.unwrap();
    let mut pool = EnvPool::new(PoolConfig::default());
    pool.add_server("echo", client.factory(), 2);
    let pool = Arc::new(pool);
    let gauge = Arc::new(Gauge::default());
    let cfg = EpisodeConfig {
        max_turns: 3,
        max_total_tokens: 1024,
    };
    let mut tasks = Vec::new();
    for i in 0..8 {
        let pool = pool.clone();
        let mut policy = ScriptedPolicy::new(&["abcd", "xy"]);
        policy.delay = Duration::from_millis(40);
        policy.gauge = Some(gauge.clone());
        tasks.push(tokio::spawn(async move {
            pool.run_episode(&mut policy, ResetOptions::seeded(i), &cfg)
                .await
        }));
    }
    for t in tasks {
        let ep = t.await.unwrap().unwrap();
        assert_eq!(ep.end, EpisodeEnd::MaxTurns, "{:?}", ep.end);
        assert!((ep.total_reward - 1.0).abs() < 1e-9);
    }
    let max = gauge.max.load(Ordering::SeqCst);
    assert!(max <= 2, "{max} episodes ran at once with a bound of 2");
    let stats = pool.stats();
    eprintln!(
        "pool: step latency p50 {:.4} s p95 {:.4} s (n={}), reset p50 {:.4} s, failures {:?}",
        stats.step.p50_s, stats.step.p95_s, stats.step.count, stats.reset.p50_s, stats.failures
    );
    assert_eq!(stats.episodes_ok, 8);
    assert_eq!(stats.episodes_failed, 0);
    assert_eq!(stats.failures.total(), 0);
    assert_eq!(stats.step.count, 24);
    assert_eq!(stats.reset.count, 8);
    assert!(stats.step.p50_s > 0.0 && stats.step.p50_s <= stats.step.p95_s);
    assert!(stats.step.p95_s <= stats.step.max_s);
    assert_eq!(stats.servers[0].in_flight, 0);
    // Sessions are reused across episodes: one per slot.
    assert_eq!(stats.servers[0].envs_created, 2);
}

#[tokio::test]
async fn timeouts_and_backoff_without_a_server() {
    // A listener that accepts TCP but never answers: every call must time out, not hang.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let cfg = OpenEnvClientConfig {
        http_timeout: Duration::from_millis(300),
        connect_timeout: Duration::from_millis(300),
        connect_retries: 2,
        initial_backoff: Duration::from_millis(50),
        ..Default::default()
    };
    match OpenEnvClient::connect(&url, cfg.clone()).await {
        Err(e @ EnvError::Timeout { .. }) => {
            assert!(e.to_string().contains("0.3 s during GET"), "{e}")
        }
        Err(e) => panic!("expected a timeout, got {e}"),
        Ok(_) => panic!("connected to a black hole"),
    }
    // Nothing listening: connection refused (its own cause, not a timeout), after the retries.
    let port = free_port();
    match OpenEnvClient::connect(&format!("http://127.0.0.1:{port}"), cfg.clone()).await {
        Err(EnvError::Refused(m)) => assert!(m.contains("/health"), "{m}"),
        other => panic!("expected a connection error, got {:?}", other.err()),
    }
    // Exponential back-off with ±25% jitter, capped.
    for attempt in 0..12 {
        let b = cfg.backoff(attempt).as_secs_f64();
        let base = (0.05 * 2f64.powi(attempt as i32)).min(cfg.max_backoff.as_secs_f64());
        assert!(
            b >= base * 0.75 - 1e-9 && b <= base * 1.25 + 1e-9,
            "{attempt}: {b}"
        );
    }
}

/// Capacity refusal, per-call timeout and a server restart mid-episode, on a server this test
/// owns (session cap 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn capacity_timeout_and_restart_on_an_own_server() {
    let Some(venv) = service_var(
        "OPENENV_VENV",
        "capacity_timeout_and_restart_on_an_own_server",
    ) else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    // Keepalive pings every 0.5 s with a 0.5 s pong deadline (uvicorn's default is 20 s / 20 s):
    // an idle session survives only if the client keeps answering pings.
    let mut server = PyServer::spawn_with(
        &PathBuf::from(venv),
        free_port(),
        1,
        logs.path(),
        &["--ws-ping-interval", "0.5", "--ws-ping-timeout", "0.5"],
    );
    server.wait_healthy().await;
    let client = OpenEnvClient::connect(&server.url(), fast_config())
        .await
        .unwrap();

    // --- capacity: the second session is refused (CAPACITY_REACHED after the 101) ...
    let mut a = client.session();
    a.reset(ResetOptions::default()).await.unwrap();
    let no_retry = OpenEnvClient::connect(
        &server.url(),
        OpenEnvClientConfig {
            capacity_retries: 0,
            ..fast_config()
        },
    )
    .await
    .unwrap();
    let mut b = no_retry.session();
    match b.reset(ResetOptions::default()).await {
        Err(e @ EnvError::Capacity(_)) => {
            assert!(e.to_string().contains("max_sessions 1"), "{e}")
        }
        other => panic!("expected CAPACITY_REACHED, got {other:?}"),
    }
    assert!(!b.is_connected());
    // ... and retried with back-off until the first session frees the slot.
    let closer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        a.close().await.unwrap();
    });
    let mut b = client.session();
    b.reset(ResetOptions::default()).await.unwrap();
    closer.await.unwrap();
    b.step(json!({"message": "ok"})).await.unwrap();

    // --- idle pings: 3 s idle (six ping rounds), the session and its state are still there.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(b.is_connected());
    b.step(json!({"message": "still"})).await.unwrap();
    assert_eq!(b.state().await.unwrap()["step_count"], 2);

    // --- per-call timeout: a paused server never answers; the socket is dropped (a late
    // reply must not be paired with the next request) and the next reset reconnects.
    let short = OpenEnvClient::connect(
        &server.url(),
        OpenEnvClientConfig {
            call_timeout: Duration::from_millis(400),
            ..fast_config()
        },
    )
    .await
    .unwrap();
    b.close().await.unwrap();
    let mut c = short.session();
    c.reset(ResetOptions::default()).await.unwrap();
    server.pause();
    let r = c.step(json!({"message": "slow"})).await;
    server.resume();
    match r {
        Err(e @ EnvError::Timeout { .. }) => assert!(e.to_string().contains("step"), "{e}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(!c.is_connected());
    assert!(matches!(
        c.step(json!({"message": "x"})).await,
        Err(EnvError::NoSession(_))
    ));
    let r = c.reset(ResetOptions::default()).await.unwrap();
    assert_eq!(r.text, "Echo Env environment ready!");
    c.close().await.unwrap();

    // --- restart mid-episode: the episode fails and is counted; the pool goes on.
    let mut pool = EnvPool::new(PoolConfig::default());
    pool.add_server("own", client.factory(), 1);
    let pool = Arc::new(pool);
    let cfg = EpisodeConfig {
        max_turns: 50,
        max_total_tokens: 100_000,
    };
    let running = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut policy = ScriptedPolicy::new(&["abc"]);
            policy.delay = Duration::from_millis(50);
            pool.run_episode(&mut policy, ResetOptions::default(), &cfg)
                .await
        })
    };
    let waiting = std::time::Instant::now();
    while pool.stats().step.count < 2 {
        assert!(
            waiting.elapsed() < Duration::from_secs(60) && !running.is_finished(),
            "the episode did not get going: {:?}",
            pool.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.stop();
    let ep = running.await.unwrap().unwrap();
    match &ep.end {
        EpisodeEnd::EnvFailed { kind, message } => {
            assert_eq!(*kind, composer_env::FailureKind::Connection, "{message}");
            eprintln!("episode during restart: {message}");
        }
        other => panic!("expected EnvFailed, got {other:?}"),
    }
    // The server comes back while the next episode's reset retries with back-off.
    server.start();
    let mut policy = ScriptedPolicy::new(&["abcd"]);
    let short_cfg = EpisodeConfig {
        max_turns: 2,
        max_total_tokens: 1024,
    };
    let ep = pool
        .run_episode(&mut policy, ResetOptions::default(), &short_cfg)
        .await
        .unwrap();
    assert_eq!(ep.end, EpisodeEnd::MaxTurns, "{:?}", ep.end);
    assert!((ep.total_reward - 0.8).abs() < 1e-9);
    let stats = pool.stats();
    eprintln!("after restart: {:?}", stats.failures);
    assert_eq!(stats.episodes_failed, 1);
    assert_eq!(stats.episodes_ok, 1);
    assert!(stats.failures.connection >= 1, "{:?}", stats.failures);
    let _: Value = client.metadata().await.unwrap();
}

#[tokio::test]
async fn episode_timeout_fails_the_episode_and_is_counted() {
    let Some(url) = service_var(
        "OPENENV_URL",
        "episode_timeout_fails_the_episode_and_is_counted",
    ) else {
        return;
    };
    let client = OpenEnvClient::connect(&url, fast_config()).await.unwrap();
    let mut pool = EnvPool::new(PoolConfig {
        episode_timeout: Duration::from_millis(500),
        ..Default::default()
    });
    pool.add_server("echo", client.factory(), 1);
    // 20 turns of 100 ms each cannot finish in 0.5 s.
    let mut slow = ScriptedPolicy::new(&["abc"]);
    slow.delay = Duration::from_millis(100);
    let cfg = EpisodeConfig {
        max_turns: 20,
        max_total_tokens: 4096,
    };
    let ep = pool
        .run_episode(&mut slow, ResetOptions::default(), &cfg)
        .await
        .unwrap();
    match &ep.end {
        EpisodeEnd::EnvFailed { kind, message } => {
            assert_eq!(*kind, composer_env::FailureKind::Timeout, "{message}")
        }
        other => panic!("expected an episode timeout, got {other:?}"),
    }
    // The slot was released: a quick episode runs next.
    let mut quick = ScriptedPolicy::new(&["ab"]);
    let ep = pool
        .run_episode(
            &mut quick,
            ResetOptions::default(),
            &EpisodeConfig {
                max_turns: 1,
                max_total_tokens: 4096,
            },
        )
        .await
        .unwrap();
    assert_eq!(ep.end, EpisodeEnd::MaxTurns);
    let stats = pool.stats();
    assert_eq!((stats.episodes_failed, stats.episodes_ok), (1, 1));
    assert_eq!(stats.failures.timeout, 1);
    // The timed-out session was closed, not reused.
    assert_eq!(stats.servers[0].envs_created, 2);
}
