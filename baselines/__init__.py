"""Training systems compared against MegaTrain, behind one protocol (megatrain.systems)."""
