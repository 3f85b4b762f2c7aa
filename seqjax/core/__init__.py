"""The pieces every stage uses: the error types, atomic file writes, progress bars."""
