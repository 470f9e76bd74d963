//! `kvroute._native`: the Python extension module behind the `kvroute` package, thin
//! bindings over the Rust crates with no logic of their own: the step API, holders and
//! requesters ([`remote`], [`step`]), the cost model ([`costmodel`]), the KV store
//! ([`kvstore`]) and the cluster simulators ([`sched`]). Errors map onto the exception
//! classes of `kvroute.errors` ([`errors`]); reports become `kvroute.Record`s with the
//! fields of the command line's `--json` ([`record`]).

mod arrays;
mod costmodel;
mod errors;
mod kvstore;
mod record;
mod remote;
mod sched;
mod step;
mod wait;

use pyo3::prelude::*;

/// The native half of the `kvroute` package; import `kvroute`, not this module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<remote::Fabric>()?;
    m.add_class::<remote::HeldChunk>()?;
    m.add_class::<remote::Holder>()?;
    m.add_class::<remote::Requester>()?;
    m.add_class::<remote::PartialAttention>()?;
    m.add_function(wrap_pyfunction!(remote::merge, m)?)?;
    m.add_class::<step::ChunkRef>()?;
    m.add_class::<step::StepRequest>()?;
    m.add_class::<step::StepOutput>()?;
    m.add_class::<step::Stepper>()?;
    m.add_class::<step::Corpus>()?;
    m.add_function(wrap_pyfunction!(costmodel::presets, m)?)?;
    m.add_function(wrap_pyfunction!(costmodel::predict, m)?)?;
    m.add_function(wrap_pyfunction!(costmodel::decide, m)?)?;
    m.add_function(wrap_pyfunction!(costmodel::plan_prfaas, m)?)?;
    m.add_function(wrap_pyfunction!(costmodel::plan_helix, m)?)?;
    m.add_class::<kvstore::PrefixCache>()?;
    m.add_class::<kvstore::BlockStore>()?;
    m.add_function(wrap_pyfunction!(kvstore::replay_trace, m)?)?;
    m.add_function(wrap_pyfunction!(sched::simulate_dualpath, m)?)?;
    m.add_function(wrap_pyfunction!(sched::simulate_prfaas, m)?)?;
    Ok(())
}
