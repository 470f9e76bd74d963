//! `.npy` files as `kvroute kernel` reads them: the header, the shape and every conversion.
//! Nothing may panic or allocate beyond what the bytes hold.
#![no_main]

use kvroute_kernels::npy::Array;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(a) = Array::parse(data) {
        let _ = (a.to_bf16(), a.to_f32(), a.to_i64());
    }
});
