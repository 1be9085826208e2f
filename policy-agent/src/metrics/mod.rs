//! Prometheus metrics and the small HTTP server that serves them with
//! /healthz and /readyz.
mod http;
mod registry;

pub use self::{
    http::{Limits, serve},
    registry::{Metrics, MetricsSource},
};
