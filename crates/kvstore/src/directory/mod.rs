//! The cluster directory: which holders are up, where they listen, and which chunks each one
//! serves, under leases, so instances join and leave without anyone editing a peer file and a
//! dead holder's chunks stop being offered within a bounded time.
//!
//! Two implementations of one [`Directory`] trait:
//!
//! - [`InProcessDirectory`] (the default, no server): holders and requesters in one process
//!   share it; a registration lives until its handle is revoked or dropped.
//! - `etcd::EtcdDirectory` (the `etcd` feature): a real etcd cluster. A holder's keys hang
//!   on a lease it keeps alive; a holder that dies stops renewing it and etcd deletes its keys
//!   when the lease's TTL runs out, which every watching requester sees as a deletion.
//!
//! # Keys and values
//!
//! Every key lies under [`PREFIX`] (`/kvroute/v1/`: the `v1` is the schema version, so a
//! later schema lives beside this one instead of being misread by it):
//!
//! - `/kvroute/v1/holders/<id>`: a [`HolderRecord`] (control address, transfer-engine
//!   address, start time) as JSON;
//! - `/kvroute/v1/chunks/<chunk>/<id>`: a [`ChunkRecord`] (replica number and the
//!   [`ChunkEntry`]: region descriptor, layout, stored positions) as JSON.
//!
//! Values carry the schema version too. Everything read back is untrusted: a value that does
//! not parse, has another schema version, disagrees with its key, fails
//! [`ChunkEntry::validate`], names a holder with no record, or claims a chunk with a layout
//! different from the copy already accepted is left out of the [`DirectoryView`] and named in
//! its `skipped` list (and logged by whoever shows the view); nothing panics on it.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvroute_transport::NetAddr;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::registry::{ChunkEntry, ChunkId, ChunkRegistry};

#[cfg(feature = "etcd")]
pub mod etcd;

/// The schema version this build writes and reads.
pub const SCHEMA: u32 = 1;
/// Where every key of this schema lies.
pub const PREFIX: &str = "/kvroute/v1/";
/// The largest value read back; anything larger is skipped unparsed (a chunk record of a
/// 64 Ki-token chunk is about 0.8 MB of JSON).
pub const MAX_VALUE_BYTES: usize = 4 << 20;
/// The longest holder id accepted.
pub const MAX_ID_BYTES: usize = 256;

/// What can go wrong talking to a directory. Bad contents are not errors: they are skipped
/// (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DirectoryError {
    /// The directory's address or a setting is malformed.
    #[error("directory configuration: {0}")]
    Config(String),
    /// The directory could not be reached or did not answer in time.
    #[error("directory {endpoints} unavailable: {why}")]
    Unavailable {
        /// Where it was looked for.
        endpoints: String,
        /// What failed.
        why: String,
    },
    /// A record this process was asked to register is malformed.
    #[error("invalid record: {0}")]
    InvalidRecord(String),
    /// This build has no client for the directory named.
    #[error("{0}")]
    Unsupported(String),
}

/// A holder as it registers itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderRecord {
    /// Schema version ([`SCHEMA`]).
    pub schema: u32,
    /// The holder's id, unique in the cluster (its control address is a good one).
    pub id: String,
    /// Where its control listener accepts sessions.
    pub control: SocketAddr,
    /// Its transfer-engine address (what its chunks' entries name as their holder).
    pub engine: NetAddr,
    /// When its process started, milliseconds since the Unix epoch.
    pub started_unix_ms: u64,
    /// When it began serving (its chunks ready, its listener open), milliseconds since the
    /// Unix epoch: where discovery latency is measured from.
    pub serving_unix_ms: u64,
}

/// One chunk a holder serves, as it registers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRecord {
    /// Schema version ([`SCHEMA`]).
    pub schema: u32,
    /// The id of the holder serving it.
    pub holder: String,
    /// Which copy this is: replicas of a chunk are offered in ascending replica number.
    pub replica: u32,
    /// Where and how the chunk is stored.
    pub entry: ChunkEntry,
}

impl HolderRecord {
    /// A record of schema [`SCHEMA`] serving (and started) now, with `control` as its id.
    pub fn new(control: SocketAddr, engine: NetAddr) -> Self {
        let now = unix_ms();
        Self {
            schema: SCHEMA,
            id: control.to_string(),
            control,
            engine,
            started_unix_ms: now,
            serving_unix_ms: now,
        }
    }

    /// Checks a record read back: schema, id, address.
    pub fn validate(&self) -> Result<(), String> {
        if self.schema != SCHEMA {
            return Err(format!(
                "schema version {} (this build reads {SCHEMA})",
                self.schema
            ));
        }
        check_id(&self.id)?;
        self.engine
            .validate()
            .map_err(|e| format!("engine address: {e}"))
    }
}

/// Milliseconds since the Unix epoch now (0 if the clock is before it).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A holder id fits in a key: 1 to [`MAX_ID_BYTES`] bytes, no `/`, no control characters.
fn check_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return Err(format!("holder id of {} bytes", id.len()));
    }
    if id.contains('/') || id.chars().any(char::is_control) {
        return Err(format!("holder id {id:?} has a '/' or a control character"));
    }
    Ok(())
}

/// The key of a holder's record.
pub fn holder_key(id: &str) -> String {
    format!("{PREFIX}holders/{id}")
}

/// The key of one chunk a holder serves (chunk ids zero-padded, so keys list in chunk order).
pub fn chunk_key(chunk: ChunkId, holder: &str) -> String {
    format!("{PREFIX}chunks/{:010}/{holder}", chunk.0)
}

/// What a key names, or why it names nothing of this schema.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Key {
    Holder(String),
    Chunk(ChunkId, String),
}

fn parse_key(key: &[u8]) -> Result<Key, String> {
    let key = std::str::from_utf8(key).map_err(|_| "key is not UTF-8".to_owned())?;
    let rest = key
        .strip_prefix(PREFIX)
        .ok_or_else(|| format!("key {key:?} outside {PREFIX}"))?;
    let parts: Vec<&str> = rest.split('/').collect();
    match parts.as_slice() {
        ["holders", id] => {
            check_id(id)?;
            Ok(Key::Holder((*id).to_owned()))
        }
        ["chunks", chunk, id] => {
            let chunk: u32 = chunk
                .parse()
                .map_err(|_| format!("key {key:?}: chunk id is not a number"))?;
            check_id(id)?;
            Ok(Key::Chunk(ChunkId(chunk), (*id).to_owned()))
        }
        _ => Err(format!("key {key:?} is not a holder or chunk key")),
    }
}

/// One registered holder in a view.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HolderView {
    /// What it registered.
    pub record: HolderRecord,
    /// The chunks it serves that were accepted, with their replica numbers.
    pub chunks: Vec<(ChunkId, u32)>,
    /// The lease its keys hang on (etcd), if any.
    pub lease: Option<i64>,
    /// Time left on that lease when the view was read, milliseconds (filled by
    /// [`Directory::view`] where the directory has leases; not by watches).
    pub ttl_left_ms: Option<u64>,
}

/// What a directory holds, validated.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DirectoryView {
    /// The registered holders, by id.
    pub holders: BTreeMap<String, HolderView>,
    /// Every accepted chunk copy, replicas in ascending replica number (then holder id).
    #[serde(skip)]
    pub registry: ChunkRegistry,
    /// Entries left out, each with why.
    pub skipped: Vec<String>,
}

impl DirectoryView {
    /// Builds a view from raw `(key, value, lease)` triples (any order), validating each (see
    /// the module documentation). Keys outside [`PREFIX`] are skipped silently: another
    /// schema's or another application's.
    pub fn from_entries<'a>(entries: impl IntoIterator<Item = (&'a [u8], &'a [u8], i64)>) -> Self {
        let mut view = Self::default();
        let mut chunks: Vec<ChunkRecord> = Vec::new();
        for (key, value, lease) in entries {
            if !key.starts_with(PREFIX.as_bytes()) {
                continue;
            }
            let name = String::from_utf8_lossy(&key[..key.len().min(300)]).into_owned();
            let skip = |why: String| format!("{name}: {why}");
            let parsed = match parse_key(key) {
                Ok(k) => k,
                Err(why) => {
                    view.skipped.push(skip(why));
                    continue;
                }
            };
            if value.len() > MAX_VALUE_BYTES {
                view.skipped
                    .push(skip(format!("value of {} bytes", value.len())));
                continue;
            }
            match parsed {
                Key::Holder(id) => match serde_json::from_slice::<HolderRecord>(value) {
                    Err(e) => view.skipped.push(skip(format!("not a holder record: {e}"))),
                    Ok(r) => match r.validate() {
                        Err(why) => view.skipped.push(skip(why)),
                        Ok(()) if r.id != id => view
                            .skipped
                            .push(skip(format!("record of holder {:?} under this key", r.id))),
                        Ok(()) => {
                            view.holders.insert(
                                id,
                                HolderView {
                                    record: r,
                                    chunks: Vec::new(),
                                    lease: (lease != 0).then_some(lease),
                                    ttl_left_ms: None,
                                },
                            );
                        }
                    },
                },
                Key::Chunk(chunk, id) => match serde_json::from_slice::<ChunkRecord>(value) {
                    Err(e) => view.skipped.push(skip(format!("not a chunk record: {e}"))),
                    Ok(c) if c.schema != SCHEMA => view.skipped.push(skip(format!(
                        "schema version {} (this build reads {SCHEMA})",
                        c.schema
                    ))),
                    Ok(c) if c.holder != id || c.entry.id != chunk => view
                        .skipped
                        .push(skip("record disagrees with its key".to_owned())),
                    Ok(c) => chunks.push(c),
                },
            }
        }
        // Lowest replica first: a conflicting claim loses to the copy offered first.
        chunks.sort_by(|a, b| {
            (a.entry.id, a.replica, &a.holder).cmp(&(b.entry.id, b.replica, &b.holder))
        });
        for c in chunks {
            let name = chunk_key(c.entry.id, &c.holder);
            let Some(holder) = view.holders.get_mut(&c.holder) else {
                view.skipped
                    .push(format!("{name}: holder {:?} has no record", c.holder));
                continue;
            };
            if c.entry.holder != holder.record.engine {
                view.skipped.push(format!(
                    "{name}: entry names another engine address than its holder's record"
                ));
                continue;
            }
            match view.registry.register(c.entry.clone()) {
                Ok(()) => holder.chunks.push((c.entry.id, c.replica)),
                Err(e) => view.skipped.push(format!("{name}: {e}")),
            }
        }
        view
    }

    /// The holder whose engine address is `engine`.
    pub fn holder_by_engine(&self, engine: &NetAddr) -> Option<&HolderView> {
        self.holders.values().find(|h| &h.record.engine == engine)
    }
}

/// The encoded keys and values of one holder's registration: its record last, so a reader
/// that sees the record (watches deliver a transaction's puts together anyway) has its chunks.
pub fn encode_registration(
    holder: &HolderRecord,
    chunks: &[ChunkRecord],
) -> Result<Vec<(String, Vec<u8>)>, DirectoryError> {
    holder.validate().map_err(DirectoryError::InvalidRecord)?;
    let mut out = Vec::with_capacity(chunks.len() + 1);
    for c in chunks {
        if c.holder != holder.id || c.entry.holder != holder.engine {
            return Err(DirectoryError::InvalidRecord(format!(
                "{} registered for holder {:?} by {:?}",
                c.entry.id, c.holder, holder.id
            )));
        }
        c.entry
            .validate()
            .map_err(|e| DirectoryError::InvalidRecord(e.to_string()))?;
        let value =
            serde_json::to_vec(c).map_err(|e| DirectoryError::InvalidRecord(e.to_string()))?;
        out.push((chunk_key(c.entry.id, &c.holder), value));
    }
    let value =
        serde_json::to_vec(holder).map_err(|e| DirectoryError::InvalidRecord(e.to_string()))?;
    out.push((holder_key(&holder.id), value));
    Ok(out)
}

/// How a registration stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegistrationStatus {
    /// Whether the keys are believed to be in the directory now.
    pub registered: bool,
    /// The lease they hang on (etcd).
    pub lease: Option<i64>,
    /// How many times the keys were written again after the lease was lost (the directory
    /// restarted without its data, or the holder could not renew within the TTL).
    pub re_registrations: u32,
    /// The last error renewing or re-registering, if the last attempt failed.
    pub last_error: Option<String>,
}

/// A holder's live registration. Revoking (or dropping) it removes the holder's keys at once;
/// a process that dies without either leaves them until the lease's TTL runs out.
pub trait Registration: Send + fmt::Debug {
    /// How it stands now.
    fn status(&self) -> RegistrationStatus;
    /// Removes the keys now (a clean shutdown).
    fn revoke(self: Box<Self>) -> Result<(), DirectoryError>;
}

/// A snapshot a [`Watch`] delivers.
#[derive(Debug, Clone)]
pub struct WatchState {
    /// Counts changes: a new view, or the watch losing or regaining the directory.
    pub generation: u64,
    /// The last view read (kept while the directory cannot be reached).
    pub view: Arc<DirectoryView>,
    /// Set while the watch has lost the directory: why. The view is then the last one seen.
    pub stale: Option<String>,
    /// When the follower published the view (it had just read it), Unix ms.
    pub published_unix_ms: u64,
}

/// A view kept current by a background follower; one slot, so a slow reader sees the newest
/// state and nothing queues up.
#[derive(Debug)]
pub struct Watch {
    slot: Arc<WatchSlot>,
    /// Stops the follower when the watch is dropped.
    _stop: Box<dyn Send + Sync + fmt::Debug>,
}

/// The shared slot a follower writes and a [`Watch`] reads.
#[derive(Debug, Default)]
pub struct WatchSlot {
    state: Mutex<Option<WatchState>>,
    changed: Condvar,
}

impl WatchSlot {
    fn lock(&self) -> MutexGuard<'_, Option<WatchState>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes a new view (clearing any stale mark).
    pub fn publish(&self, view: DirectoryView) {
        let mut s = self.lock();
        let generation = s.as_ref().map_or(1, |s| s.generation + 1);
        *s = Some(WatchState {
            generation,
            view: Arc::new(view),
            stale: None,
            published_unix_ms: unix_ms(),
        });
        crate::observe::directory_view();
        self.changed.notify_all();
    }

    /// Marks the current view stale (the directory was lost), once per loss.
    pub fn mark_stale(&self, why: String) {
        let mut s = self.lock();
        if let Some(state) = s.as_mut()
            && state.stale.is_none()
        {
            state.generation += 1;
            state.stale = Some(why);
            crate::observe::directory_stale();
            self.changed.notify_all();
        }
    }
}

impl Watch {
    /// A watch over `slot`, whose follower stops when `stop` is dropped.
    pub fn new(slot: Arc<WatchSlot>, stop: Box<dyn Send + Sync + fmt::Debug>) -> Self {
        Self { slot, _stop: stop }
    }

    /// The newest state, once the follower has read the directory once.
    pub fn current(&self) -> Option<WatchState> {
        self.slot.lock().clone()
    }

    /// The first state newer than `generation`, or the current one after `timeout`.
    pub fn wait_newer(&self, generation: u64, timeout: Duration) -> Option<WatchState> {
        let deadline = Instant::now() + timeout;
        let mut s = self.slot.lock();
        loop {
            if s.as_ref().is_some_and(|s| s.generation > generation) {
                return s.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return s.clone();
            }
            s = self
                .slot
                .changed
                .wait_timeout(s, left)
                .map_or_else(|p| p.into_inner().0, |(g, _)| g);
        }
    }
}

/// A cluster directory: holders register, requesters list and watch.
pub trait Directory: Send + Sync + fmt::Debug {
    /// Registers `holder` and the chunks it serves; the registration lasts until the handle
    /// is revoked or dropped, or (etcd) the process stops renewing it for a TTL.
    fn register(
        &self,
        holder: HolderRecord,
        chunks: Vec<ChunkRecord>,
    ) -> Result<Box<dyn Registration>, DirectoryError>;
    /// What the directory holds now (with TTLs left, where it has leases).
    fn view(&self) -> Result<DirectoryView, DirectoryError>;
    /// A view kept current in the background.
    fn watch(&self) -> Result<Watch, DirectoryError>;
    /// Where it is, for messages: `in-process`, `etcd at HOST:PORT,...`.
    fn describe(&self) -> String;
}

/// Opens the directory `url` names: `etcd://HOST:PORT[,HOST:PORT...]` (the `etcd` feature),
/// or `in-process` (a fresh [`InProcessDirectory`], only useful inside one process). `ttl` is
/// how long a registration outlives its holder's last renewal (etcd).
pub fn open(url: &str, ttl: Duration) -> Result<Arc<dyn Directory>, DirectoryError> {
    if url == "in-process" {
        return Ok(Arc::new(InProcessDirectory::new()));
    }
    let Some(endpoints) = url.strip_prefix("etcd://") else {
        return Err(DirectoryError::Config(format!(
            "directory {url:?}: expected etcd://HOST:PORT[,HOST:PORT] or in-process"
        )));
    };
    let endpoints: Vec<String> = endpoints
        .split(',')
        .map(|e| e.trim().to_owned())
        .filter(|e| !e.is_empty())
        .collect();
    if endpoints.is_empty() {
        return Err(DirectoryError::Config(format!(
            "directory {url:?} names no endpoint"
        )));
    }
    #[cfg(feature = "etcd")]
    {
        Ok(Arc::new(etcd::EtcdDirectory::connect(
            &endpoints,
            etcd::EtcdConfig::with_ttl(ttl)?,
        )?))
    }
    #[cfg(not(feature = "etcd"))]
    {
        let _ = (endpoints, ttl);
        Err(DirectoryError::Unsupported(
            "this build of kvroute-kvstore has no etcd client (the `etcd` feature)".to_owned(),
        ))
    }
}

/// The in-process directory: a map behind a lock, shared by clones. Registrations have no
/// TTL (a holder in this process cannot die without dropping its handle).
#[derive(Debug, Clone, Default)]
pub struct InProcessDirectory {
    inner: Arc<InProcess>,
}

/// Key -> (value, lease).
type Entries = BTreeMap<String, (Vec<u8>, u64)>;

#[derive(Debug, Default)]
struct InProcess {
    /// The last lease handed out, and the entries.
    entries: Mutex<(u64, Entries)>,
    watchers: Mutex<Vec<std::sync::Weak<WatchSlot>>>,
}

impl InProcess {
    fn snapshot(&self) -> DirectoryView {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        DirectoryView::from_entries(
            entries
                .1
                .iter()
                .map(|(k, (v, lease))| (k.as_bytes(), v.as_slice(), *lease as i64)),
        )
    }

    fn notify(&self) {
        let view = self.snapshot();
        let mut watchers = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        watchers.retain(|w| w.strong_count() > 0);
        for w in watchers.iter().filter_map(std::sync::Weak::upgrade) {
            w.publish(view.clone());
        }
    }

    fn remove_lease(&self, lease: u64) {
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .retain(|_, (_, l)| *l != lease);
        self.notify();
    }
}

impl InProcessDirectory {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes a raw value under `key` with no lease (what a foreign or broken writer could
    /// put there: for tests of the validation).
    pub fn put_raw(&self, key: &str, value: &[u8]) {
        self.inner
            .entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .insert(key.to_owned(), (value.to_vec(), 0));
        self.inner.notify();
    }
}

#[derive(Debug)]
struct InProcessRegistration {
    dir: Arc<InProcess>,
    lease: u64,
    revoked: bool,
}

impl Registration for InProcessRegistration {
    fn status(&self) -> RegistrationStatus {
        RegistrationStatus {
            registered: !self.revoked,
            lease: Some(self.lease as i64),
            re_registrations: 0,
            last_error: None,
        }
    }

    fn revoke(mut self: Box<Self>) -> Result<(), DirectoryError> {
        self.revoked = true;
        self.dir.remove_lease(self.lease);
        Ok(())
    }
}

impl Drop for InProcessRegistration {
    fn drop(&mut self) {
        if !self.revoked {
            self.dir.remove_lease(self.lease);
        }
    }
}

impl Directory for InProcessDirectory {
    fn register(
        &self,
        holder: HolderRecord,
        chunks: Vec<ChunkRecord>,
    ) -> Result<Box<dyn Registration>, DirectoryError> {
        let kvs = encode_registration(&holder, &chunks)?;
        let lease = {
            let mut entries = self.inner.entries.lock().unwrap_or_else(|p| p.into_inner());
            entries.0 += 1;
            let lease = entries.0;
            for (k, v) in kvs {
                entries.1.insert(k, (v, lease));
            }
            lease
        };
        self.inner.notify();
        Ok(Box::new(InProcessRegistration {
            dir: self.inner.clone(),
            lease,
            revoked: false,
        }))
    }

    fn view(&self) -> Result<DirectoryView, DirectoryError> {
        Ok(self.inner.snapshot())
    }

    fn watch(&self) -> Result<Watch, DirectoryError> {
        let slot = Arc::new(WatchSlot::default());
        slot.publish(self.inner.snapshot());
        self.inner
            .watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(&slot));
        Ok(Watch::new(slot, Box::new(())))
    }

    fn describe(&self) -> String {
        "in-process".to_owned()
    }
}

#[cfg(test)]
mod tests;
