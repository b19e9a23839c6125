//! Clocks and throttle reasons from NVML, loaded at run time, for every GPU plugin's measurement
//! records: a number measured while the GPU was power- or heat-throttled says so. Without NVML
//! (no driver) the clocks are `null`.

use std::sync::OnceLock;

use serde_json::{json, Value};

/// Clocks and active throttle reasons of GPU 0 now, or `null` without NVML. NVML is opened once
/// per process: `nvmlInit` costs tens to hundreds of milliseconds, too much for every cell.
pub fn clocks() -> Value {
    static SHARED: OnceLock<Option<Nvml>> = OnceLock::new();
    SHARED
        .get_or_init(Nvml::open)
        .as_ref()
        .map_or(Value::Null, Nvml::sample)
}

type Device = *mut std::ffi::c_void;

pub struct Nvml {
    _library: libloading::Library,
    device: Device,
    clock: unsafe extern "C" fn(Device, u32, *mut u32) -> i32,
    reasons: unsafe extern "C" fn(Device, *mut u64) -> i32,
}

// SAFETY: NVML handles may be used from any thread, concurrently (NVML is thread-safe).
unsafe impl Send for Nvml {}
unsafe impl Sync for Nvml {}

const CLOCK_GRAPHICS: u32 = 0;
const CLOCK_SM: u32 = 1;
const CLOCK_MEM: u32 = 2;

/// The throttle-reason bits NVML defines, by name.
const REASONS: [(u64, &str); 9] = [
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
];

impl Nvml {
    /// NVML for GPU 0, or `None` when the library or the device is not there.
    fn open() -> Option<Nvml> {
        // SAFETY: NVML's documented entry points, called with the types its header declares.
        unsafe {
            let library = libloading::Library::new("libnvidia-ml.so.1")
                .or_else(|_| libloading::Library::new("libnvidia-ml.so"))
                .ok()?;
            let init: libloading::Symbol<unsafe extern "C" fn() -> i32> =
                library.get(b"nvmlInit_v2\0").ok()?;
            if init() != 0 {
                return None;
            }
            let by_index: libloading::Symbol<unsafe extern "C" fn(u32, *mut Device) -> i32> =
                library.get(b"nvmlDeviceGetHandleByIndex_v2\0").ok()?;
            let mut device: Device = std::ptr::null_mut();
            if by_index(0, &mut device) != 0 {
                return None;
            }
            let clock = *library
                .get::<unsafe extern "C" fn(Device, u32, *mut u32) -> i32>(
                    b"nvmlDeviceGetClockInfo\0",
                )
                .ok()?;
            let reasons = *library
                .get::<unsafe extern "C" fn(Device, *mut u64) -> i32>(
                    b"nvmlDeviceGetCurrentClocksEventReasons\0",
                )
                .or_else(|_| library.get(b"nvmlDeviceGetCurrentClocksThrottleReasons\0"))
                .ok()?;
            Some(Nvml {
                _library: library,
                device,
                clock,
                reasons,
            })
        }
    }

    /// Clocks (MHz) and active throttle reasons now.
    pub fn sample(&self) -> Value {
        let clock = |kind| {
            let mut mhz = 0u32;
            // SAFETY: `device` came from NVML; `mhz` is a valid out pointer.
            (unsafe { (self.clock)(self.device, kind, &mut mhz) } == 0).then_some(mhz)
        };
        let mut bits = 0u64;
        // SAFETY: as above.
        let reasons_ok = unsafe { (self.reasons)(self.device, &mut bits) } == 0;
        let active: Vec<&str> = REASONS
            .iter()
            .filter(|(bit, _)| bits & bit != 0)
            .map(|(_, name)| *name)
            .collect();
        json!({
            "sm_mhz": clock(CLOCK_SM),
            "graphics_mhz": clock(CLOCK_GRAPHICS),
            "memory_mhz": clock(CLOCK_MEM),
            "throttle_reasons": if reasons_ok { json!(active) } else { Value::Null },
        })
    }
}
