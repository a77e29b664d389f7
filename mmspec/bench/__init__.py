"""Measuring code behind `mmspec bench`, `mmspec demo` and the scripts in benchmarks/.
Speed is always a ratio measured side by side in one run; nothing here is a test."""
