"""lmtp"""
