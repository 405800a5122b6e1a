"""Host-side optimizer use and its parity with torch.optim.AdamW."""
