pub mod pull;
