"""Prepared media: sampled, resized frames stored fleet-wide (the prepare tier's frame store,
its codecs, planar pixels, host buffers and the size budget)."""
