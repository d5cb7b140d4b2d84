"""DeepSeek-V3 (and Kimi-K2's text model): config reading and tensor table (``family``)."""
