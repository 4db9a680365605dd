"""The arithmetic of a run: cost and prices, the plan's numbers, memory, the LR schedule, the fitter and the loss laws."""
