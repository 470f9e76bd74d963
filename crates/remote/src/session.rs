//! The rendezvous (docs/route.md, "Rendezvous"): a requester opens a TCP connection to a holder's
//! control listener and sends one JSON line, [`Hello`]; the holder answers [`Welcome`] (a
//! session: an inbox slot, its immediate, the chunks it holds) or [`Answer::Busy`] when it already
//! serves its cap of requesters (paper 000 section 6.3's ~8 elbow). The requester then proves
//! that the engine address of its hello is its own: it names the endpoint it sends from if
//! that is another ([`Control::Sender`]), sends the session's proof message from its engine
//! ([`crate::wire::encode_proof`]) and asks ([`Control::Prove`]); the holder's transport names
//! each message's sender, and a session whose proof came from elsewhere is closed unserved. The session lives as long
//! as the connection: closing it, or the requester dying, frees the slot. Data never crosses
//! this connection; it carries descriptors, and [`Control::Stats`] on request.

use std::io::BufReader;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use kvroute_kvstore::ChunkEntry;
use kvroute_transport::{DoneFlag, MrDesc, NetAddr, OnDone, TransferEngine};
use serde::{Deserialize, Serialize};

use crate::control::{recv_line, send_line};
use crate::error::RemoteError;
use crate::wire;

/// The requester's first line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// The requester's transfer-engine address.
    pub addr: NetAddr,
    /// The requester's reply region for this holder.
    pub reply: MrDesc,
    /// The requester's paged pool, if it fetches.
    pub pool: Option<MrDesc>,
    /// The immediate the holder's reply writes carry.
    pub reply_imm: u32,
    /// The immediate the holder's fetch page writes carry.
    pub fetch_imm: u32,
}

/// The holder's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Answer {
    /// A session.
    Welcome(Welcome),
    /// At the cap: try later or elsewhere.
    Busy {
        /// Requesters being served.
        active: usize,
        /// The cap.
        cap: usize,
    },
    /// The hello was malformed.
    Refused(String),
}

/// A granted session.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Welcome {
    /// The session number (in the request immediate).
    pub session: u16,
    /// The session's secret: every request and ping of the session carries it, and the holder
    /// answers nothing without it. Random, known only to the holder and this connection's
    /// peer (the control connection is its only channel).
    pub token: u64,
    /// The holder's engine address.
    pub holder: NetAddr,
    /// This session's inbox: a region of its own (no other session's descriptor reaches it).
    pub inbox: MrDesc,
    /// Where in the inbox the session's requests go.
    pub slot_offset: u64,
    /// Slot bytes: the largest request.
    pub slot_bytes: u64,
    /// Bytes of the largest reply the holder stages.
    pub reply_bytes: u64,
    /// Bytes of gathered rows one request may ask for (all its gather segments together):
    /// the holder packs them into this session's staging before writing them out.
    #[serde(default)]
    pub gather_bytes: u64,
    /// The chunks the holder serves.
    pub chunks: Vec<ChunkEntry>,
}

/// Lines a requester may send after the hello.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Control {
    /// Ask for the holder's counters.
    Stats,
    /// The address the requester's engine sends to the holder from, when it is not the
    /// hello's ([`kvroute_transport::TransferEngine::sender_address`]): an `shm` holder maps
    /// every endpoint that sends to it and can forget one only by name, which it learns here
    /// (and tells the sender of each message by it). Sent before anything is sent from it;
    /// answered [`Ack`].
    Sender(NetAddr),
    /// Asks whether the session's proof message ([`crate::wire::encode_proof`]), sent just
    /// before from the requester's engine, reached the holder from the hello's address; the
    /// holder answers [`Ack`] and serves the session only if it did (otherwise it closes it).
    Prove,
}

/// The holder's answer to [`Control::Sender`] and [`Control::Prove`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Ack {
    /// Whether the holder took the sending address, or found the proof.
    pub ok: bool,
}

/// A holder's counters, since it started. A batch of requests (or a ping) is counted, its
/// times included, under the lock its replies are sent in: counters read after a reply landed
/// include that reply's batch.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct HolderStats {
    /// Requests parsed (well formed or not).
    pub requests: u64,
    /// Segments served.
    pub segments: u64,
    /// Kernel calls (one per batch of segments on the same chunk and layer).
    pub kernel_calls: u64,
    /// Query rows attended.
    pub rows: u64,
    /// Sum over kernel calls of rows x attended entries (whole chunk, or the selection):
    /// with `kernel_us`, the holder's achieved rate.
    #[serde(default)]
    pub row_tokens: u64,
    /// Of `rows`, those attended on a GPU, over chunks resident there.
    #[serde(default)]
    pub gpu_rows: u64,
    /// Bytes of held chunks resident on a GPU (0: the partials run on the CPU).
    #[serde(default)]
    pub gpu_resident_bytes: u64,
    /// Time in kernels, microseconds.
    pub kernel_us: f64,
    /// The holder's kernel roofline, measured on its machine at start and refitted from the
    /// calls it serves. From the peer: validate before pricing with it.
    #[serde(default)]
    pub kernel: Option<crate::kernel_rate::HolderKernel>,
    /// Time serving batches, from taking the arrivals to posting the last reply (kernels
    /// included), microseconds: `serve_us - kernel_us` is the holder's own host overhead.
    #[serde(default)]
    pub serve_us: f64,
    /// Of `serve_us`, the time encoding partial rows to the bf16 wire, microseconds: byte
    /// conversion a GPU holder fuses into its kernel's epilogue.
    #[serde(default)]
    pub encode_us: f64,
    /// Batches served (each one or more requests).
    #[serde(default)]
    pub batches: u64,
    /// Pings answered (raw write round trips, no kernel).
    #[serde(default)]
    pub pings: u64,
    /// Time writing the bytes of [`super::wire::Pong::Written`] pongs before sending them,
    /// microseconds.
    #[serde(default)]
    pub pong_write_us: f64,
    /// Requests or segments refused as malformed.
    pub refused: u64,
    /// Immediates that named no session.
    pub stray_imms: u64,
    /// Fetches started.
    pub fetches: u64,
    /// Sessions turned away at the cap.
    pub busy: u64,
    /// Sessions closed by the holder: one that sent no request or ping within the holder's
    /// `open_timeout`, or one idle for `idle_evict` when a new requester found every slot
    /// taken.
    #[serde(default)]
    pub evicted: u64,
    /// Sessions active now.
    pub active: u64,
    /// Sessions served at once before new requesters are told busy (paper 000 section 6.3's
    /// cap per holder).
    #[serde(default)]
    pub cap: u64,
}

/// Opens a session for `engine` on a holder's control connection (`writer` and a reader over
/// the same socket): sends `hello`, reads the answer and, for a welcome, proves that the
/// hello's address is `engine`'s ([`Control::Sender`] if it sends from another endpoint, the
/// proof message, [`Control::Prove`]). Returns the welcome; a busy or refusing holder, or a
/// proof it did not receive from this engine, is an error. [`crate::Requester::connect`] does
/// this for each holder; it is public for requesters of their own.
pub fn open(
    engine: &TransferEngine,
    (writer, reader): (&mut TcpStream, &mut BufReader<TcpStream>),
    hello: &Hello,
    timeout: Duration,
) -> Result<Welcome, RemoteError> {
    let holder = writer
        .peer_addr()
        .map_err(RemoteError::io("reading a holder's address"))?;
    send_line(writer, holder, hello)?;
    let welcome = match recv_line::<Answer>(reader, holder, 64 << 20)? {
        Answer::Welcome(w) => w,
        Answer::Busy { active, cap } => {
            return Err(RemoteError::HolderBusy {
                holder,
                active,
                cap,
            });
        }
        Answer::Refused(why) => return Err(RemoteError::SessionRefused { holder, why }),
    };
    prove(engine, (writer, reader), holder, &welcome, timeout)?;
    Ok(welcome)
}

/// Proves to the holder that the hello's engine address is this engine's (see
/// [`crate::session`]): names the endpoint this engine sends to the holder from, if it is not
/// the main address (the holder needs the name both to attribute the proof and to forget the
/// endpoint later), sends the session's proof message, and asks.
fn prove(
    engine: &TransferEngine,
    (writer, reader): (&mut TcpStream, &mut BufReader<TcpStream>),
    holder: SocketAddr,
    welcome: &Welcome,
    timeout: Duration,
) -> Result<(), RemoteError> {
    let refused = |why: &str| RemoteError::SessionRefused {
        holder,
        why: why.to_owned(),
    };
    if let Some(sender) = engine.sender_address(&welcome.holder)? {
        send_line(writer, holder, &Control::Sender(sender))?;
        if !recv_line::<Ack>(reader, holder, 1 << 10)?.ok {
            return Err(refused("the holder refused this engine's sending address"));
        }
    }
    let sent = DoneFlag::new();
    engine.submit_send(
        &welcome.holder,
        &wire::encode_proof(welcome.session, welcome.token),
        OnDone::flag(&sent),
    )?;
    let deadline = Instant::now() + timeout;
    let proved = crate::requester::wait_all(
        engine,
        &[&sent],
        deadline,
        Duration::from_millis(1),
        Some(&*writer),
    );
    match proved {
        Ok(()) => {}
        Err(crate::requester::Unfinished::Late(_)) => {
            return Err(RemoteError::TimedOut {
                holder,
                after: timeout,
            });
        }
        Err(crate::requester::Unfinished::Closed(why)) => return Err(refused(&why)),
    }
    send_line(writer, holder, &Control::Prove)?;
    if !recv_line::<Ack>(reader, holder, 1 << 10)?.ok {
        return Err(refused(
            "the holder did not receive this session's proof from this engine's address",
        ));
    }
    Ok(())
}
