"""A plugin declaring plugin API 1.0 while its mixer claims sequence_data_parallel, which came with 1.1."""
