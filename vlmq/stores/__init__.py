"""Object stores: results, staged media, job input and output files, prepared frames."""
