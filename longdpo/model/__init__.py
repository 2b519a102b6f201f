"""Building the model and the memory levers that wrap its modules."""
