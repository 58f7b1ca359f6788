//! The simulator's tests, in one binary (one link step on a small machine).

mod cli;
mod common;

mod fault_knobs;
mod pages;
mod replay;
mod rewind;
mod sender_http;
mod stories;
mod wire_shapes;
