"""Data on disk: SFT conversations (`sft_data`)."""
