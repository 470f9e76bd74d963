//! Loading libfabric leaves the process's signal dispositions as they were. Debian's build
//! links PSM libraries whose constructors install a backtrace handler for SIGSEGV, SIGINT,
//! SIGTERM and others; a crash then could hang in that handler instead of ending the process.
//! This test runs alone in its binary so that nothing loaded the library before it looks.

#![allow(unsafe_code)]

/// Each signal's handler (`SIG_DFL`, `SIG_IGN` or a function's address). The flags are left
/// out: restoring an action through libc adds `SA_RESTORER`, which changes nothing.
fn dispositions() -> Vec<(libc::c_int, usize)> {
    (1..32)
        .filter_map(|signal| {
            // SAFETY: reads the current action into a zeroed out-parameter.
            let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
            let read = unsafe { libc::sigaction(signal, std::ptr::null(), &mut action) };
            (read == 0).then_some((signal, action.sa_sigaction))
        })
        .collect()
}

#[test]
fn loading_libfabric_leaves_every_signal_disposition_as_it_was() {
    let before = dispositions();
    match libfabric_sys::library() {
        Ok(library) => {
            let after = dispositions();
            assert_eq!(
                before,
                after,
                "loading {} changed signal dispositions",
                library.path()
            );
        }
        Err(e) => eprintln!("skipped: no libfabric here ({e})"),
    }
}
