"""NemotronH (Mamba-attention hybrid MoE): config reading and tensor table (``family``)."""
