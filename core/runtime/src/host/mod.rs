//! The plugin host: finding and loading plugin libraries ([`plugin`]), the services a running
//! stage is lent ([`services`], [`node_sink`]), worker processes for stages that may crash, hang
//! or need a device ([`worker`]), and the lock that keeps measurements on one machine apart
//! ([`machine_lock`]).

pub mod machine_lock;
pub(crate) mod node_sink;
pub mod plugin;
pub mod services;
pub mod worker;
