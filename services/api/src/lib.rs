//! The control plane (skeleton: being built).
