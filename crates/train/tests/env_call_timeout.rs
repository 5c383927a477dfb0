//! `[env] call_timeout_s` against the longest step a server declares (`step_time_limit_s` in
//! its /metadata): a repository-task server (commands up to 30 s, grading up to 120 s) refuses a
//! 60 s call timeout at start-up, naming the key and the server's figure — a cut step would
//! fail its episode instead of grading it, which a policy could use to escape a losing grade —
//! and takes one above it. `[env] episode_timeout_s` must exceed twice the call timeout.

use std::path::Path;

use composer_env::repo::{EpisodeBudget, RepoEnv};
use composer_env::{serve_env_until, ServeConfig};
use composer_train::env_rollout::EnvRollout;
use composer_train::recipe::EnvSection;

/// The shipped repository tasks served on a free port until the returned sender is dropped.
fn serve_repo_tasks() -> (String, tokio::sync::oneshot::Sender<()>) {
    let tasks = Path::new(env!("CARGO_MANIFEST_DIR")).join("../env/repo_tasks/tasks");
    let factory = RepoEnv::factory(&tasks, EpisodeBudget::default()).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            addr_tx.send(listener.local_addr().unwrap()).unwrap();
            serve_env_until(factory, listener, ServeConfig::default(), async move {
                let _ = stop_rx.await;
            })
            .await
            .unwrap();
        });
    });
    (format!("http://{}", addr_rx.recv().unwrap()), stop_tx)
}

fn section(url: &str, call_timeout_s: f64) -> EnvSection {
    toml::from_str(&format!(
        "kind = \"openenv\"\nurl = \"{url}\"\ncall_timeout_s = {call_timeout_s:?}\n\
         episode_timeout_s = 1000.0\n"
    ))
    .unwrap()
}

#[test]
fn a_call_timeout_shorter_than_the_servers_longest_step_is_refused() {
    let (url, _stop) = serve_repo_tasks();
    let e = match EnvRollout::new(&section(&url, 60.0), None) {
        Ok(_) => panic!("a 60 s call timeout was accepted"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains("[env] call_timeout_s")
            && e.contains("step_time_limit_s")
            && e.contains("155")
            && e.contains(&url),
        "{e}"
    );
    EnvRollout::new(&section(&url, 160.0), None).expect("a call timeout above the longest step");
}

#[test]
fn an_episode_timeout_within_two_call_timeouts_is_refused() {
    let text = format!(
        "{}\n[env]\nkind = \"builtin\"\nname = \"echo\"\ncall_timeout_s = 30.0\n\
         episode_timeout_s = 60.0\n",
        composer_train::recipe::EMBEDDED_DEFAULT_RECIPE
    );
    let e = format!(
        "{:#}",
        composer_train::recipe::parse_recipe(&text, Path::new("r.toml")).unwrap_err()
    );
    assert!(
        e.contains("[env] episode_timeout_s") && e.contains("[env] call_timeout_s"),
        "{e}"
    );
}
