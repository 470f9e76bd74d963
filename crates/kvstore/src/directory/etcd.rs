//! The directory on etcd (v3 API over gRPC, through the `etcd-client` crate).
//!
//! The client is asynchronous; [`EtcdDirectory`] owns a one-worker tokio runtime and gives a
//! blocking API, so holders and requesters (plain threads) use it without a runtime of their
//! own. Its background tasks:
//!
//! - per registration, a keeper: renews the lease every third of its TTL; if etcd answers
//!   that the lease is gone (it expired while the holder could not reach etcd, or etcd
//!   restarted without its data), it writes the keys again under a new lease; while etcd
//!   cannot be reached it retries every [`EtcdConfig::retry`];
//! - per watch, a follower: lists the prefix, publishes the view, then watches from the next
//!   revision and publishes after every batch of events. When the stream breaks (etcd
//!   restarted, the member it talked to died) it marks the view stale (the watcher keeps the
//!   last one and can say so), and lists and watches again, through any member that answers.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Client, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
};
use tokio::runtime::Runtime;
use tokio::sync::watch as signal;

use super::{
    ChunkRecord, Directory, DirectoryError, DirectoryView, HolderRecord, PREFIX, Registration,
    RegistrationStatus, Watch, WatchSlot, encode_registration,
};

/// etcd's default limit on operations in one transaction is 128; registrations are written in
/// transactions of at most this many puts.
const TXN_OPS: usize = 64;

/// How the etcd directory behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EtcdConfig {
    /// How long a registration outlives its holder's last renewal (whole seconds, at least 2:
    /// etcd's minimum with its default election timeout).
    pub ttl: Duration,
    /// How long one request may take before etcd counts as unavailable.
    pub timeout: Duration,
    /// How long a keeper or follower waits before trying again after losing etcd.
    pub retry: Duration,
    /// Bytes of values a view holds at most: a value that would take it past this is left
    /// out and named (`DirectoryView::skipped`), so that whoever can write under the prefix
    /// cannot grow a requester's memory without bound.
    pub view_bytes: usize,
}

impl EtcdConfig {
    /// A TTL of `ttl` (rounded up to whole seconds), 2 s requests, 250 ms retries, views of
    /// at most 64 MiB of values.
    pub fn with_ttl(ttl: Duration) -> Result<Self, DirectoryError> {
        let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        if !(2..=3600).contains(&secs) {
            return Err(DirectoryError::Config(format!(
                "a lease TTL of {ttl:?}: 2 s to 1 h"
            )));
        }
        Ok(Self {
            ttl: Duration::from_secs(secs),
            timeout: Duration::from_secs(2),
            retry: Duration::from_millis(250),
            view_bytes: 64 << 20,
        })
    }
}

/// A directory on an etcd cluster.
pub struct EtcdDirectory {
    runtime: Arc<Runtime>,
    members: Members,
    config: EtcdConfig,
}

/// One client per member, tried in turn from the one that last answered: etcd-client's own
/// balanced channel keeps sending to a member that is down (its connections are made lazily,
/// so a dead member looks ready until a call to it fails).
#[derive(Clone)]
struct Members {
    clients: Arc<Vec<(String, Client)>>,
    preferred: Arc<AtomicUsize>,
    timeout: Duration,
}

/// Why a call to the cluster failed.
#[derive(Debug)]
enum Failure {
    /// A member answered with an error: the request itself failed (another member would say
    /// the same).
    Answered(etcd_client::Error),
    /// No member answered in time: each one's reason.
    Unreachable(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Answered(e) => write!(f, "{e}"),
            Self::Unreachable(why) => f.write_str(why),
        }
    }
}

impl From<Failure> for String {
    fn from(f: Failure) -> Self {
        f.to_string()
    }
}

/// Whether `e` is an answer from etcd (not a transport failure or an unavailable member).
fn answered(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => !matches!(
            s.code(),
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
        ),
        etcd_client::Error::LeaseKeepAliveError(why) => why == "lease not found",
        _ => false,
    }
}

impl Members {
    /// `HOST:PORT,...` of every member.
    fn endpoints(&self) -> String {
        let names: Vec<&str> = self.clients.iter().map(|(e, _)| e.as_str()).collect();
        names.join(",")
    }

    /// `f` on the preferred member, then on each other one until one answers in time.
    async fn call<T, Fut>(&self, mut f: impl FnMut(Client) -> Fut) -> Result<T, Failure>
    where
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let n = self.clients.len();
        let first = self.preferred.load(Ordering::Relaxed);
        let mut errors = Vec::with_capacity(n);
        for k in 0..n {
            let i = (first + k) % n;
            let (endpoint, client) = &self.clients[i];
            match tokio::time::timeout(self.timeout, f(client.clone())).await {
                Ok(Ok(v)) => {
                    self.preferred.store(i, Ordering::Relaxed);
                    return Ok(v);
                }
                Ok(Err(e)) if answered(&e) => return Err(Failure::Answered(e)),
                Ok(Err(e)) => errors.push(format!("{endpoint}: {e}")),
                Err(_) => errors.push(format!("{endpoint}: no answer within {:?}", self.timeout)),
            }
        }
        Err(Failure::Unreachable(errors.join("; ")))
    }
}

impl std::fmt::Debug for EtcdDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDirectory")
            .field("endpoints", &self.members.endpoints())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// `fut` with a deadline, its error (or the timeout) as text.
async fn within<T, E: std::fmt::Display>(
    timeout: Duration,
    fut: impl Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

impl EtcdDirectory {
    /// Connects to the cluster at `endpoints` (`HOST:PORT` each) and checks that it answers.
    pub fn connect(endpoints: &[String], config: EtcdConfig) -> Result<Self, DirectoryError> {
        let joined = endpoints.join(",");
        let unavailable = |why: String| DirectoryError::Unavailable {
            endpoints: joined.clone(),
            why,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvroute-etcd")
            .enable_all()
            .build()
            .map_err(|e| unavailable(format!("starting the client's runtime: {e}")))?;
        let options = ConnectOptions::new()
            .with_connect_timeout(config.timeout)
            // HTTP/2 pings find a dead connection without traffic; etcd closes a connection
            // that pings more often than every 5 s (its --grpc-keepalive-min-time).
            .with_keep_alive(Duration::from_secs(10), config.timeout)
            .with_keep_alive_while_idle(true);
        let mut clients = Vec::with_capacity(endpoints.len());
        for e in endpoints {
            // No connection is made here: the first call connects.
            let client = runtime
                .block_on(within(
                    config.timeout,
                    Client::connect([e.as_str()], Some(options.clone())),
                ))
                .map_err(|why| DirectoryError::Config(format!("etcd endpoint {e:?}: {why}")))?;
            clients.push((e.clone(), client));
        }
        let dir = Self {
            runtime: Arc::new(runtime),
            members: Members {
                clients: Arc::new(clients),
                preferred: Arc::new(AtomicUsize::new(0)),
                timeout: config.timeout,
            },
            config,
        };
        // One read says whether anything answers.
        dir.runtime
            .block_on(dir.members.call(|mut c| async move {
                c.get(
                    PREFIX,
                    Some(GetOptions::new().with_prefix().with_count_only()),
                )
                .await
            }))
            .map_err(|f| unavailable(f.to_string()))?;
        Ok(dir)
    }

    fn unavailable(&self, why: String) -> DirectoryError {
        DirectoryError::Unavailable {
            endpoints: self.members.endpoints(),
            why,
        }
    }
}

/// Grants a lease of `ttl_s` and writes `kvs` under it; returns the lease. (A retry on another
/// member may leave an unused lease behind: it expires after its TTL.)
async fn write_under_new_lease(
    members: &Members,
    kvs: &[(String, Vec<u8>)],
    ttl_s: i64,
) -> Result<i64, String> {
    let lease = members
        .call(|mut c| async move { c.lease_grant(ttl_s, None).await })
        .await?
        .id();
    for batch in kvs.chunks(TXN_OPS) {
        let ops: Vec<TxnOp> = batch
            .iter()
            .map(|(k, v)| {
                TxnOp::put(
                    k.as_str(),
                    v.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                )
            })
            .collect();
        let txn = Txn::new().and_then(ops);
        members
            .call(|mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
    }
    Ok(lease)
}

/// Why a keeper's renewal loop ended.
enum Renewal {
    Stopped,
    /// etcd answered that the lease no longer exists.
    Gone,
}

/// Renews `lease` every third of the TTL until stopped or etcd says it is gone; while etcd
/// cannot be reached, retries (through any member).
async fn renew(
    members: &Members,
    lease: i64,
    config: EtcdConfig,
    status: &Mutex<RegistrationStatus>,
    stop: &mut signal::Receiver<bool>,
) -> Renewal {
    let period = config.ttl / 3;
    loop {
        let opened = members
            .call(|mut c| async move { c.lease_keep_alive(lease).await })
            .await;
        let (mut keeper, mut stream) = match opened {
            Ok(pair) => pair,
            // etcd answers a renewal of an unknown lease with a TTL of 0, which the client
            // reports as this error when it opens the renewal stream.
            Err(Failure::Answered(etcd_client::Error::LeaseKeepAliveError(_))) => {
                return Renewal::Gone;
            }
            Err(why) => {
                renewal(status, false, Some(format!("renewing the lease: {why}")));
                if pause(config.retry, stop).await {
                    return Renewal::Stopped;
                }
                continue;
            }
        };
        loop {
            let answer = tokio::time::timeout(config.timeout, async {
                keeper.keep_alive().await?;
                stream.message().await
            })
            .await;
            match answer {
                Ok(Ok(Some(r))) if r.ttl() > 0 => renewal(status, true, None),
                Ok(Ok(Some(_))) => return Renewal::Gone,
                Ok(Ok(None)) => {
                    renewal(status, false, Some("renewal stream ended".to_owned()));
                    break;
                }
                Ok(Err(e)) => {
                    renewal(status, false, Some(format!("renewing the lease: {e}")));
                    break;
                }
                Err(_) => {
                    renewal(
                        status,
                        false,
                        Some(format!("no renewal answer within {:?}", config.timeout)),
                    );
                    break;
                }
            }
            if pause(period, stop).await {
                return Renewal::Stopped;
            }
        }
        if pause(config.retry, stop).await {
            return Renewal::Stopped;
        }
    }
}

/// A renewal's outcome: counted, and noted in the registration's status.
fn renewal(status: &Mutex<RegistrationStatus>, ok: bool, error: Option<String>) {
    crate::observe::directory_renewal(ok);
    note(status, ok, error);
}

fn note(status: &Mutex<RegistrationStatus>, registered: bool, error: Option<String>) {
    let mut s = status.lock().unwrap_or_else(|p| p.into_inner());
    s.registered = registered;
    s.last_error = error;
}

/// Sleeps `d`; true if told to stop meanwhile (or the sender is gone).
async fn pause(d: Duration, stop: &mut signal::Receiver<bool>) -> bool {
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        () = tokio::time::sleep(d) => *stop.borrow(),
        changed = stop.changed() => changed.is_err() || *stop.borrow(),
    }
}

/// The keeper of one registration (see the module documentation).
async fn keep(
    members: Members,
    kvs: Vec<(String, Vec<u8>)>,
    config: EtcdConfig,
    status: Arc<Mutex<RegistrationStatus>>,
    mut stop: signal::Receiver<bool>,
) {
    let ttl_s = config.ttl.as_secs() as i64;
    loop {
        let lease = status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .lease
            .unwrap_or(0);
        match renew(&members, lease, config, &status, &mut stop).await {
            Renewal::Stopped => return,
            Renewal::Gone if *stop.borrow() => return,
            Renewal::Gone => {
                note(&status, false, Some("the lease expired".to_owned()));
                tracing::warn!(lease, "directory lease gone: registering again");
            }
        }
        loop {
            match write_under_new_lease(&members, &kvs, ttl_s).await {
                Ok(new) => {
                    let mut s = status.lock().unwrap_or_else(|p| p.into_inner());
                    s.lease = Some(new);
                    s.registered = true;
                    s.re_registrations += 1;
                    s.last_error = None;
                    crate::observe::directory_registration(true, true);
                    break;
                }
                Err(why) => {
                    crate::observe::directory_registration(true, false);
                    note(&status, false, Some(format!("registering again: {why}")));
                }
            }
            if pause(config.retry, &mut stop).await {
                return;
            }
        }
    }
}

/// A registration on etcd: its keeper task, stopped and its lease revoked on revoke or drop.
struct EtcdRegistration {
    runtime: Arc<Runtime>,
    members: Members,
    status: Arc<Mutex<RegistrationStatus>>,
    stop: signal::Sender<bool>,
    /// The keeper, waited for before the lease is revoked: a keeper still running could
    /// take the revoked lease for an expired one and register again.
    keeper: Option<tokio::task::JoinHandle<()>>,
    timeout: Duration,
    revoked: bool,
}

impl std::fmt::Debug for EtcdRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRegistration")
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

impl EtcdRegistration {
    fn end(&mut self) -> Result<(), DirectoryError> {
        self.revoked = true;
        let _ = self.stop.send(true);
        if let Some(keeper) = self.keeper.take() {
            // It stops at its next pause, or after the request in flight (each within the
            // request timeout, the re-registration's grant and puts within a few).
            let limit = self.timeout * 4;
            let finished = self
                .runtime
                .block_on(async { tokio::time::timeout(limit, keeper).await });
            if finished.is_err() {
                tracing::warn!("directory keeper still running after {limit:?}; revoking anyway");
            }
        }
        let Some(lease) = self.status().lease else {
            return Ok(());
        };
        self.runtime
            .block_on(
                self.members
                    .call(|mut c| async move { c.lease_revoke(lease).await }),
            )
            .map(|_| ())
            .map_err(|why| DirectoryError::Unavailable {
                endpoints: self.members.endpoints(),
                why: format!("revoking lease {lease}: {why}"),
            })
    }
}

impl Registration for EtcdRegistration {
    fn status(&self) -> RegistrationStatus {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn revoke(mut self: Box<Self>) -> Result<(), DirectoryError> {
        self.end()
    }
}

impl Drop for EtcdRegistration {
    fn drop(&mut self) {
        if !self.revoked {
            let _ = self.end();
        }
    }
}

/// The follower of one watch (see the module documentation).
async fn follow(
    members: Members,
    slot: Arc<WatchSlot>,
    config: EtcdConfig,
    mut stop: signal::Receiver<bool>,
) {
    loop {
        let why = tokio::select! {
            why = follow_once(&members, &slot, config.view_bytes) => why,
            _ = stop.changed() => return,
        };
        tracing::warn!(%why, "directory watch lost; keeping the last view");
        slot.mark_stale(why);
        if pause(config.retry, &mut stop).await {
            return;
        }
    }
}

/// Lists, publishes, and follows the watch stream until it fails; returns why.
async fn follow_once(members: &Members, slot: &WatchSlot, view_bytes: usize) -> String {
    let (revision, mut listing) = match list(members, view_bytes).await {
        Ok(listed) => listed,
        Err(why) => return format!("listing: {why}"),
    };
    slot.publish(listing.view());
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1);
    let mut stream = match members
        .call(|mut c| {
            let options = options.clone();
            async move { c.watch(PREFIX, Some(options)).await }
        })
        .await
    {
        Ok(s) => s,
        Err(why) => return format!("watching: {why}"),
    };
    loop {
        match stream.message().await {
            Ok(Some(r)) if r.canceled() => {
                return format!("watch canceled by etcd: {}", r.cancel_reason());
            }
            Ok(Some(r)) => {
                if r.events().is_empty() {
                    continue;
                }
                crate::observe::directory_watch_events(r.events().len());
                for event in r.events() {
                    let Some(kv) = event.kv() else { continue };
                    match event.event_type() {
                        EventType::Put => listing.put(kv.key(), kv.value(), kv.lease()),
                        EventType::Delete => listing.delete(kv.key()),
                    }
                }
                slot.publish(listing.view());
            }
            Ok(None) => return "watch stream ended".to_owned(),
            Err(e) => return format!("watch stream: {e}"),
        }
    }
}

/// The entries a follower or a listing holds, within a budget of value bytes.
#[derive(Debug, Default)]
struct Listing {
    /// Key to (value, lease).
    entries: BTreeMap<Vec<u8>, (Vec<u8>, i64)>,
    /// Keys left out, and why.
    unread: BTreeMap<Vec<u8>, String>,
    /// Bytes of the values held.
    bytes: usize,
    /// The most bytes of values held.
    budget: usize,
}

impl Listing {
    fn new(budget: usize) -> Self {
        Self {
            budget,
            ..Self::default()
        }
    }

    /// Holds `value` under `key` (in place of what it held), unless that takes the values
    /// past the budget: then the key is left out and named.
    fn put(&mut self, key: &[u8], value: &[u8], lease: i64) {
        self.delete(key);
        if self.bytes + value.len() > self.budget {
            self.unread.insert(
                key.to_vec(),
                format!(
                    "{} bytes would take the view past its {} bytes",
                    value.len(),
                    self.budget
                ),
            );
            return;
        }
        self.bytes += value.len();
        self.entries.insert(key.to_vec(), (value.to_vec(), lease));
    }

    fn delete(&mut self, key: &[u8]) {
        self.unread.remove(key);
        if let Some((old, _)) = self.entries.remove(key) {
            self.bytes -= old.len();
        }
    }

    fn view(&self) -> DirectoryView {
        let mut view = DirectoryView::from_entries(
            self.entries
                .iter()
                .map(|(k, (v, lease))| (k.as_slice(), v.as_slice(), *lease)),
        );
        view.skipped.extend(
            self.unread
                .iter()
                .map(|(k, why)| format!("{}: not read: {why}", String::from_utf8_lossy(k))),
        );
        view
    }
}

/// Every entry under [`PREFIX`] at one revision, read key by key: first the keys alone, then
/// each value on its own, so that no listing is one message of every value (values that
/// together pass the client's 4 MiB decode limit failed every listing). A value etcd answers
/// with an error (one too large to decode) is left out and named with why; a member that
/// does not answer fails the listing; values past `view_bytes` are left out and named.
/// Returns the revision and the listing.
async fn list(members: &Members, view_bytes: usize) -> Result<(i64, Listing), Failure> {
    let keys = members
        .call(|mut c| async move {
            c.get(
                PREFIX,
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await
        })
        .await?;
    let revision = keys.header().map_or(0, |h| h.revision());
    let mut listing = Listing::new(view_bytes);
    for kv in keys.kvs() {
        let key = kv.key().to_vec();
        let got = members
            .call(|mut c| {
                let key = key.clone();
                async move {
                    c.get(key, Some(GetOptions::new().with_revision(revision)))
                        .await
                }
            })
            .await;
        match got {
            Ok(r) => {
                if let Some(kv) = r.kvs().first() {
                    listing.put(kv.key(), kv.value(), kv.lease());
                }
            }
            Err(Failure::Answered(e)) => {
                listing.unread.insert(key, e.to_string());
            }
            Err(unreachable) => return Err(unreachable),
        }
    }
    Ok((revision, listing))
}

impl Directory for EtcdDirectory {
    fn register(
        &self,
        holder: HolderRecord,
        chunks: Vec<ChunkRecord>,
    ) -> Result<Box<dyn Registration>, DirectoryError> {
        let kvs = encode_registration(&holder, &chunks)?;
        let ttl_s = self.config.ttl.as_secs() as i64;
        let lease = self
            .runtime
            .block_on(write_under_new_lease(&self.members, &kvs, ttl_s))
            .inspect(|_| crate::observe::directory_registration(false, true))
            .map_err(|why| {
                crate::observe::directory_registration(false, false);
                self.unavailable(format!("registering {}: {why}", holder.id))
            })?;
        let status = Arc::new(Mutex::new(RegistrationStatus {
            registered: true,
            lease: Some(lease),
            re_registrations: 0,
            last_error: None,
        }));
        let (stop, stopped) = signal::channel(false);
        let keeper = self.runtime.spawn(keep(
            self.members.clone(),
            kvs,
            self.config,
            status.clone(),
            stopped,
        ));
        Ok(Box::new(EtcdRegistration {
            runtime: self.runtime.clone(),
            members: self.members.clone(),
            status,
            stop,
            keeper: Some(keeper),
            timeout: self.config.timeout,
            revoked: false,
        }))
    }

    fn view(&self) -> Result<DirectoryView, DirectoryError> {
        let (members, view_bytes) = (&self.members, self.config.view_bytes);
        self.runtime
            .block_on(async {
                let (_, listing) = list(members, view_bytes).await?;
                let mut view = listing.view();
                for holder in view.holders.values_mut() {
                    if let Some(lease) = holder.lease {
                        let left = members
                            .call(|mut c| async move { c.lease_time_to_live(lease, None).await })
                            .await?;
                        holder.ttl_left_ms = u64::try_from(left.ttl()).ok().map(|s| s * 1000);
                    }
                }
                Ok::<_, String>(view)
            })
            .map_err(|why| self.unavailable(why))
    }

    fn watch(&self) -> Result<Watch, DirectoryError> {
        let slot = Arc::new(WatchSlot::default());
        let (stop, stopped) = signal::channel(false);
        self.runtime.spawn(follow(
            self.members.clone(),
            slot.clone(),
            self.config,
            stopped,
        ));
        // The watch keeps the runtime its follower runs on.
        let watch = Watch::new(slot, Box::new((stop, self.runtime.clone())));
        // The first view, or the reason there is none.
        match watch.wait_newer(0, self.config.timeout * 2) {
            Some(_) => Ok(watch),
            None => Err(self.unavailable("no first listing".to_owned())),
        }
    }

    fn describe(&self) -> String {
        format!("etcd at {}", self.members.endpoints())
    }
}
