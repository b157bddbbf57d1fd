"""The commands: each module here is one entry point, built the same way (settings -> flags ->
validated settings -> the library call). Only this package imports absl flags."""
