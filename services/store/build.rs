// `sqlx::migrate!` embeds migrations/ at compile time: rebuild when a migration is added or
// changed, not only when Rust code changes.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
