//! The system's libibverbs, for everything that is not a ringbell object.
//!
//! The library is found with `dlopen("libibverbs.so.1")` rather than `RTLD_NEXT`: a program
//! such as Python loads libibverbs through an extension module opened `RTLD_LOCAL`, which
//! `RTLD_NEXT` from a preloaded library cannot see. The handle names libibverbs itself, so
//! a symbol looked up through it is libibverbs' own definition, never this library's.

use std::ffi::CStr;
use std::sync::OnceLock;

/// The handle of the system's libibverbs (0: not installed).
fn handle() -> usize {
    static HANDLE: OnceLock<usize> = OnceLock::new();
    *HANDLE.get_or_init(|| {
        // SAFETY: dlopen with a NUL-terminated constant name; loading libibverbs runs its
        // constructors, which is what linking it would do.
        unsafe { libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_NOW) as usize }
    })
}

/// The address of libibverbs' definition of `name` (its default version), or 0.
pub(crate) fn symbol(name: &CStr) -> usize {
    let h = handle();
    if h == 0 {
        return 0;
    }
    // SAFETY: `h` is a live dlopen handle (never closed) and `name` is NUL-terminated.
    unsafe { libc::dlsym(h as *mut libc::c_void, name.as_ptr()) as usize }
}

/// Calls libibverbs' own `$name` with the arguments, typed as the prototype given; evaluates
/// to `None` when libibverbs is not installed or lacks the symbol.
macro_rules! forward {
    ($name:literal, fn($($t:ty),* $(,)?) -> $r:ty, ($($a:expr),* $(,)?) $(,)?) => {{
        static SYM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        let p = *SYM.get_or_init(|| {
            $crate::real::symbol(
                std::ffi::CStr::from_bytes_with_nul(concat!($name, "\0").as_bytes())
                    .unwrap_or(c"-"),
            )
        });
        if p == 0 {
            None
        } else {
            // SAFETY: `p` is libibverbs' definition of this exported function, whose C
            // prototype is the one written at this call site (from <infiniband/verbs.h>).
            let f: unsafe extern "C" fn($($t),*) -> $r = unsafe { std::mem::transmute(p) };
            // SAFETY: the arguments are the caller's, passed through unchanged.
            Some(unsafe { f($($a),*) })
        }
    }};
}
pub(crate) use forward;
