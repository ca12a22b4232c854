//! The HTTP room: both listeners and what they serve.
//!
//! - [`public`]: `:8080` (`/healthz`, `/readyz`, `/metrics`);
//! - [`control`]: `:8081`, the control-plane routes (`/snapshot`, `/policy`, `/checkpoint`,
//!   `/digest`, `/probe`), each authenticating first;
//! - [`probe`]: the synthetic probe behind `/probe`;
//! - [`json`]: the Go-compatible JSON writer of `/snapshot`;
//! - [`serve`]: HTTP/1.1 serving with the read-header timeout and the bounded graceful stop.

pub mod control;
pub mod json;
pub mod probe;
pub mod public;
pub mod serve;

pub use public::{public_router, serve_public};
