//! Unit tests of the slot array, classes and backends.
