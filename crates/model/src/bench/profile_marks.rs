//! Phase marks for `tools/cupti_profile`, the CUPTI injection library that records where a
//! process's GPU time goes (the lent GPU machines have no profiler). When the CUDA driver has
//! loaded that library (`CUDA_INJECTION64_PATH`), [`profile_phase`] calls its
//! `composer_profile_phase`, which closes the running phase and opens the next; otherwise it
//! does nothing. Callers synchronise the device first, so a phase holds exactly the kernels
//! launched in it.

use std::ffi::{c_char, CString};
use std::os::unix::ffi::OsStrExt;
use std::sync::OnceLock;

type MarkFn = unsafe extern "C" fn(*const c_char);

/// The injected library's mark function, looked up once (after CUDA's initialisation).
fn mark_fn() -> Option<MarkFn> {
    static MARK: OnceLock<Option<MarkFn>> = OnceLock::new();
    *MARK.get_or_init(|| {
        let path = CString::new(std::env::var_os("CUDA_INJECTION64_PATH")?.as_bytes()).ok()?;
        // SAFETY: RTLD_NOLOAD never loads anything: it returns the handle of the library the
        // CUDA driver already loaded from this path, or null.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if handle.is_null() {
            return None;
        }
        // SAFETY: a symbol lookup in a valid handle.
        let sym = unsafe { libc::dlsym(handle, c"composer_profile_phase".as_ptr()) };
        // SAFETY: the library defines `extern "C" void composer_profile_phase(const char*)`.
        (!sym.is_null()).then(|| unsafe { std::mem::transmute::<*mut libc::c_void, MarkFn>(sym) })
    })
}

/// Opens the profiled phase `label` (closing the previous one) when the CUPTI profiler is
/// injected; a no-op otherwise. Synchronise the device before calling.
pub fn profile_phase(label: &str) {
    if let Some(mark) = mark_fn() {
        let label = CString::new(label.replace('\0', " ")).unwrap_or_default();
        // SAFETY: a valid NUL-terminated string, only read during the call.
        unsafe { mark(label.as_ptr()) };
    }
}
