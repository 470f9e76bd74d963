//! CUDA memory as dma-bufs for the verbs domain (feature `cuda`): the driver's
//! `cuMemGetHandleForAddressRange` exports a device range, the NIC registers it with
//! `ibv_reg_dmabuf_mr`. Nothing is linked: cudarc opens `libcuda` at run time, and where there
//! is none [`CudaDmaBuf::new`] says so. Not run on a GPU.

use cudarc::driver::sys;

use super::DmaBufExporter;
use crate::error::TransportError;
use crate::mr::Device;

/// Exports the memory of CUDA device `ordinal`.
#[derive(Debug)]
pub struct CudaDmaBuf {
    ordinal: u32,
}

fn unavailable(why: String) -> TransportError {
    TransportError::ProviderUnavailable(format!("cuda dma-buf: {why}"))
}

impl CudaDmaBuf {
    /// An exporter for device `ordinal`; an error where there is no driver, no such device, or
    /// a device without dma-buf support.
    pub fn new(ordinal: u32) -> Result<Self, TransportError> {
        // SAFETY: only checks whether the driver library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(unavailable(
                "libcuda.so not found (no NVIDIA driver on this machine)".to_owned(),
            ));
        }
        // SAFETY: the driver is present; cuInit is idempotent.
        let rc = unsafe { sys::cuInit(0) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(unavailable(format!("cuInit failed ({rc:?})")));
        }
        let mut device = 0;
        // SAFETY: a valid out-pointer.
        let rc = unsafe { sys::cuDeviceGet(&mut device, ordinal as i32) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(unavailable(format!("no CUDA device {ordinal} ({rc:?})")));
        }
        let mut supported = 0;
        // SAFETY: a valid device and out-pointer.
        let rc = unsafe {
            sys::cuDeviceGetAttribute(
                &mut supported,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
                device,
            )
        };
        if rc != sys::CUresult::CUDA_SUCCESS || supported == 0 {
            return Err(unavailable(format!(
                "CUDA device {ordinal} cannot export dma-bufs (driver 470+ and kernel 5.12+ needed)"
            )));
        }
        Ok(Self { ordinal })
    }
}

impl DmaBufExporter for CudaDmaBuf {
    fn device(&self) -> Device {
        Device::Cuda {
            ordinal: self.ordinal,
        }
    }

    fn export(&self, addr: u64, len: u64) -> Result<(i32, u64), TransportError> {
        // The driver exports whole host pages: widen the range and report the offset.
        let page = 4096u64;
        let start = addr & !(page - 1);
        let end = addr
            .checked_add(len)
            .map(|e| e.div_ceil(page) * page)
            .ok_or(TransportError::InvalidArgument(
                "a device range wraps around",
            ))?;
        let mut fd: i32 = -1;
        // SAFETY: a valid out-pointer for an int descriptor; the range is the caller's
        // registration, which the driver checks.
        let rc = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut i32).cast(),
                start,
                (end - start) as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        if rc != sys::CUresult::CUDA_SUCCESS || fd < 0 {
            return Err(unavailable(format!(
                "cuMemGetHandleForAddressRange of [{start:#x}, {end:#x}) failed ({rc:?})"
            )));
        }
        Ok((fd, addr - start))
    }

    fn release(&self, fd: i32) {
        // SAFETY: a descriptor `export` created and handed over; closed once.
        unsafe { libc::close(fd) };
    }
}
