//! The publisher (skeleton: being built).
