"""The configuration schema every section is written in (``Section``, ``setting``), its types and
its one error type; torch-free. The sections themselves live in the packages they configure."""
