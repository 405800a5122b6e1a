"""Training systems compared against MegaTrain, behind one protocol (baselines.protocol)."""
