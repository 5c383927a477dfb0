//! The server's sessions: one env each, made by a WebSocket connection (owned by it) or by
//! JSON-RPC `openenv/session/create` over HTTP (then used by `tools/call` with its
//! `session_id`, and attachable by one WebSocket `/ws?session_id=ID`), as openenv 0.10 does.
//! Both kinds count against `max_sessions`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::builtin::new_episode_id;
use crate::env::Env;

/// An env shared by the HTTP `/mcp` requests and the WebSocket of one session; calls on it
/// take turns.
pub(crate) type SharedEnv = Arc<tokio::sync::Mutex<Box<dyn Env>>>;

struct Entry {
    env: SharedEnv,
    /// A WebSocket is attached (or owns it).
    attached: bool,
    /// Destroy when the WebSocket detaches: a WebSocket-made session, or one whose
    /// `openenv/session/close` came while a WebSocket was attached.
    close_on_detach: bool,
    /// When it was made, last looked up, or last detached from.
    last_used: Instant,
}

/// Why a session could not be made or used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SessionError {
    /// `max` sessions are open already.
    Capacity { active: usize, max: usize },
    /// No session has this id.
    Unknown(String),
    /// A WebSocket is attached to this session already.
    AlreadyAttached(String),
}

impl std::fmt::Display for SessionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionError::Capacity { active, max } => write!(
                f,
                "Server at capacity ({active}/{max} sessions). Try again later."
            ),
            SessionError::Unknown(id) => write!(f, "Unknown session_id: {id}"),
            SessionError::AlreadyAttached(id) => {
                write!(f, "Session {id} already has an attached WebSocket")
            }
        }
    }
}

/// What `openenv/session/close` did.
pub(crate) enum CloseOutcome {
    /// Removed; the caller closes the env.
    Closed(SharedEnv),
    /// A WebSocket is attached: the session ends when it detaches.
    Closing,
    /// No such session.
    Unknown,
}

/// The open sessions, at most `max`.
pub(crate) struct SessionStore {
    max: usize,
    /// A session without a WebSocket unused this long is ended ([`SessionStore::reap_idle`]).
    idle_timeout: Duration,
    map: Mutex<HashMap<String, Entry>>,
}

impl SessionStore {
    /// An empty store for at most `max` sessions; unattached sessions unused for
    /// `idle_timeout` are ended.
    pub(crate) fn new(max: usize, idle_timeout: Duration) -> SessionStore {
        SessionStore {
            max,
            idle_timeout,
            map: Mutex::new(HashMap::new()),
        }
    }

    /// Removes the sessions without a WebSocket that nobody used for the idle timeout (an
    /// HTTP client that made one and vanished); the caller closes their envs. Without this
    /// they would hold `max_sessions` slots, and their episodes' sandboxes, forever.
    pub(crate) fn reap_idle(&self) -> Vec<SharedEnv> {
        let mut map = self.lock();
        let idle: Vec<String> = map
            .iter()
            .filter(|(_, e)| !e.attached && e.last_used.elapsed() >= self.idle_timeout)
            .map(|(id, _)| id.clone())
            .collect();
        idle.iter()
            .filter_map(|id| {
                tracing::info!(
                    "session {id}: unused for {:?}; ending it",
                    self.idle_timeout
                );
                map.remove(id).map(|e| e.env)
            })
            .collect()
    }

    /// How often [`SessionStore::reap_idle`] should run.
    pub(crate) fn reap_every(&self) -> Duration {
        (self.idle_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(30))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // A panic while holding this lock leaves the map consistent (single inserts/removes).
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Open sessions.
    pub(crate) fn active(&self) -> usize {
        self.lock().len()
    }

    /// The most sessions.
    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// Whether a new session would fit now (checked before making its env).
    pub(crate) fn check_room(&self) -> Result<(), SessionError> {
        let active = self.active();
        if active >= self.max {
            return Err(SessionError::Capacity {
                active,
                max: self.max,
            });
        }
        Ok(())
    }

    /// Adds a session holding `env`; `websocket`: made by (and attached to) a WebSocket,
    /// which ends it on disconnect. On a full store the env comes back with the error.
    #[allow(clippy::result_large_err)] // the env is handed back so the caller can close it
    pub(crate) fn insert(
        &self,
        env: Box<dyn Env>,
        websocket: bool,
    ) -> Result<(String, SharedEnv), (SessionError, Box<dyn Env>)> {
        let mut map = self.lock();
        if map.len() >= self.max {
            let err = SessionError::Capacity {
                active: map.len(),
                max: self.max,
            };
            return Err((err, env));
        }
        let id = new_episode_id();
        let env: SharedEnv = Arc::new(tokio::sync::Mutex::new(env));
        map.insert(
            id.clone(),
            Entry {
                env: Arc::clone(&env),
                attached: websocket,
                close_on_detach: websocket,
                last_used: Instant::now(),
            },
        );
        Ok((id, env))
    }

    /// The env of session `id`.
    pub(crate) fn get(&self, id: &str) -> Result<SharedEnv, SessionError> {
        let mut map = self.lock();
        let entry = map
            .get_mut(id)
            .ok_or_else(|| SessionError::Unknown(id.to_string()))?;
        entry.last_used = Instant::now();
        Ok(Arc::clone(&entry.env))
    }

    /// Attaches a WebSocket to the HTTP-made session `id` (one at a time).
    pub(crate) fn attach(&self, id: &str) -> Result<SharedEnv, SessionError> {
        let mut map = self.lock();
        let entry = map
            .get_mut(id)
            .ok_or_else(|| SessionError::Unknown(id.to_string()))?;
        if entry.attached {
            return Err(SessionError::AlreadyAttached(id.to_string()));
        }
        entry.attached = true;
        Ok(Arc::clone(&entry.env))
    }

    /// Detaches the WebSocket of session `id`; returns the env when the session ends now
    /// (the caller closes it).
    pub(crate) fn detach(&self, id: &str) -> Option<SharedEnv> {
        let mut map = self.lock();
        let entry = map.get_mut(id)?;
        entry.attached = false;
        entry.last_used = Instant::now();
        if entry.close_on_detach {
            map.remove(id).map(|e| e.env)
        } else {
            None
        }
    }

    /// `openenv/session/close` of session `id`.
    pub(crate) fn close(&self, id: &str) -> CloseOutcome {
        let mut map = self.lock();
        match map.get_mut(id) {
            None => CloseOutcome::Unknown,
            Some(entry) if entry.attached => {
                entry.close_on_detach = true;
                CloseOutcome::Closing
            }
            Some(_) => match map.remove(id) {
                Some(e) => CloseOutcome::Closed(e.env),
                None => CloseOutcome::Unknown,
            },
        }
    }

    /// Removes every session (server shutdown); the caller closes the envs.
    pub(crate) fn drain(&self) -> Vec<SharedEnv> {
        self.lock().drain().map(|(_, e)| e.env).collect()
    }
}

/// Closes a session's env (waiting for a call in flight on it to finish).
pub(crate) async fn close_env(env: SharedEnv) {
    let _ = env.lock().await.close().await;
}

/// Ends unused sessions without a WebSocket now and then ([`SessionStore::reap_idle`]); runs
/// until aborted.
pub(crate) async fn reap_idle_sessions(sessions: Arc<SessionStore>) {
    loop {
        tokio::time::sleep(sessions.reap_every()).await;
        for env in sessions.reap_idle() {
            close_env(env).await;
        }
    }
}
