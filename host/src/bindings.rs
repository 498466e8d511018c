//! Rust types and traits generated from `wit/middleware.wit`.

wasmtime::component::bindgen!({
    path: "../wit",
    world: "middleware",
});
