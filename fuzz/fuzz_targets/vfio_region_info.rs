//! A vfio-user server's DEVICE_GET_REGION_INFO reply, as the driver's client parses it
//! (`ringbell::vfio::user::mappable_windows`): any bytes give windows or an error, never a
//! panic, and the windows it gives are safe to map.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(windows) = ringbell::vfio::user::mappable_windows(data) else {
        return;
    };
    // The region's size, from the reply (bytes 16..24 of the region info).
    let size = u64::from_le_bytes(data[16..24].try_into().unwrap());
    let mut end_prev = 0;
    for &(off, len) in &windows {
        let end = off.checked_add(len).expect("a window wraps");
        assert!(
            len > 0 && end <= size,
            "window {off:#x}+{len:#x} outside {size:#x}"
        );
        assert!(off >= end_prev, "windows overlap or are unsorted");
        end_prev = end;
    }
});
