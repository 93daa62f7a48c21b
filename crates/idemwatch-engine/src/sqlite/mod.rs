//! SQLite's plumbing, shared by the store's SQLite backend and the embedded queue: the
//! sqlx pool options and pragmas ([`conn`]), and the one writer thread per database
//! file their hot paths run on ([`thread`]). Neither knows the store's tables or the
//! queue's; both hand back driver errors, which each caller reads as its own.

pub(crate) mod conn;
pub(crate) mod thread;
