//! The rendezvous connection's lines, as any peer may send them: hellos, answers, control
//! messages, and the addresses and region descriptors inside them (validated as a holder
//! does). Nothing may panic.
#![no_main]

use kvroute_remote::session::{Answer, Control, Hello, HolderStats};
use kvroute_transport::{MrDesc, NetAddr};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(hello) = serde_json::from_slice::<Hello>(data) {
        let _ = hello.addr.validate();
        let _ = hello.reply.net_addr().validate();
        if let Some(pool) = &hello.pool {
            let _ = pool.net_addr() == hello.addr;
        }
    }
    if let Ok(Answer::Welcome(w)) = serde_json::from_slice::<Answer>(data) {
        let _ = w.inbox.net_addr().validate();
        let _ = w.holder.validate();
    }
    let _ = serde_json::from_slice::<Control>(data);
    let _ = serde_json::from_slice::<HolderStats>(data);
    if let Ok(addr) = serde_json::from_slice::<NetAddr>(data) {
        let _ = addr.validate();
    }
    if let Ok(desc) = serde_json::from_slice::<MrDesc>(data) {
        let _ = desc.net_addr().validate();
    }
});
