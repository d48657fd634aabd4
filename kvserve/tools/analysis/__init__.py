"""Back-of-the-envelope inference analysis: the roofline (`kvserve roofline`)."""
