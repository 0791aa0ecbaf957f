"""FIXME"""
